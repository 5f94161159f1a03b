"""llmgw router: an OpenAI-compatible HTTP proxy in front of llama-server replicas.

It keeps an in-memory table of defined models, the planner's parked /
unplaceable state and their passing endpoints, fed by Consul blocking-query
watches (:mod:`router.watch`): a model is defined while it has a record under
Consul KV ``llmgw/models/`` or an ``llmgw-<model>`` service in Consul's
catalog, so wiping KV never turns a serving model into a 404; its state comes
from ``llmgw/routing/``, the part of the planner's state it acts on
(decoded only where a document changed: :mod:`router.states`), its
endpoints from the health of its service, all with a fixed number of
queries however many models there are. The shapes of all of these (key
and service names, documents, activation answers) are the shared
contract, :mod:`llmgw_contract`.

It forwards every model-addressed ``POST`` (OpenAI's and llama-server's model
routes, exactly as listed in :mod:`router.routes`; nothing else reaches a
replica) to the least-loaded replica with a free slot (or, with ``--routing
prefix``, to the replica its prompt's prefix hashes to, within a bounded load:
:mod:`router.prefix`), skipping replicas ejected for failing
(:mod:`router.outliers`): each replica takes at most its llama-server slot
count (``/props``) at once, and the rest wait in order for a bounded time
(:mod:`router.admission`). A request is retried on another replica only when
it provably never reached one, or the one it reached sent nothing and proved
dead (:mod:`router.firstbyte`). Parked, unplaceable and stopped models are
refused at once with the reason (:mod:`router.refusals`); a model with no
passing endpoint is activated through the planner's API and the request held,
for a bounded time, until a replica passes (:mod:`router.activation`). Every
interval the router tells the planner which models it used
(:mod:`router.usage`). Both calls follow the planner leader through Consul
(``llmgw/leader`` and the ``llmgw-planner`` service; :mod:`router.planners`),
with the configured ``--planner-url`` the first address tried while Consul
names no leader, and move to another planner only when one could not be
reached at all (:mod:`router.plannerapi`).

Optional API keys (:mod:`router.keys`, from a file or Consul KV, edited with
``router keys``: :mod:`router.keyscli`) gate every request and the model list,
with per-key limits (:mod:`router.limits`); the client's ``Authorization`` is
not passed to replicas. Request bodies held at once, and the time a client may take to send
its headers and body, are bounded (:mod:`router.intake`, :mod:`router.serving`).

Entry points: the ``router`` console script (:mod:`router.cli`) and
:func:`create_app` for embedding the ASGI app. The router never imports the
planner; the two talk over HTTP and share only :mod:`llmgw_contract`.
"""

from router.app import create_app
from router.settings import RouterSettings

__all__ = ["RouterSettings", "create_app"]
