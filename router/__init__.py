"""llmgw router: an OpenAI-compatible HTTP proxy in front of llama-server replicas.

It keeps an in-memory table of defined models (Consul KV ``llmgw/models/``),
the planner's parked / unplaceable state (``llmgw/state/``) and their passing
endpoints (Consul health of service ``llmgw-<model>``), fed by blocking-query
watches, and forwards ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/embeddings`` to the least-loaded replica. Parked and unplaceable models
are refused at once with the reason (:mod:`router.refusals`); a model with no
passing endpoint is activated through the planner's API and the request held,
for a bounded time, until a replica passes (:mod:`router.activation`). Every
interval the router tells the planner which models it used (:mod:`router.usage`).

Entry points: the ``router`` console script (:mod:`router.cli`) and
:func:`create_app` for embedding the ASGI app. The router never imports the
planner; the two talk over HTTP.
"""

from router.app import create_app
from router.settings import RouterSettings

__all__ = ["RouterSettings", "create_app"]
