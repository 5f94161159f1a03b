"""Cache-aware choice of replica: consistent hashing of the prompt's prefix, with bounded loads.

llama-server keeps each slot's KV cache and reuses it for a request whose
prompt starts the same way (``cache_prompt``, on by default; its answer
reports the reused tokens in ``timings.cache_n`` and, in OpenAI's shape,
``usage.prompt_tokens_details.cached_tokens``). A multi-turn chat resends the
whole conversation each turn, so a turn sent to the replica that served the
previous one skips recomputing everything before the new message; sent to
another replica, it pays for all of it again.

Chosen by the ``routing`` setting (``LLMGW_ROUTING=prefix``,
:mod:`router.settings`); the default stays least-outstanding requests
(:func:`router.balancer.pick`). With ``prefix``, the proxy computes a key
per request (:func:`request_prefix`) and :func:`router.balancer.pick` asks
:func:`choose` first:

- **The key**: the first ``chars`` characters (100) of the first user
  message of a chat, or of the prompt of a completion: what every turn of
  one conversation shares and different conversations usually do not
  (KubeAI's PrefixHash hashes the same, ``prefixCharLength`` 100). ``None``
  (no text: embeddings of token arrays, a body without messages) falls back
  to least-outstanding.
- **The ring**: each replica at ``replication`` (256) points of a 64-bit hash
  ring (BLAKE2b of its address, so every router puts a replica at the same
  points and sends a prefix to the same replica); the key's hash picks a point
  and the walk goes clockwise (Karger et al., consistent hashing).
- **Bounded loads**: the walk takes the first replica whose requests in
  flight, counting this one, stay within ``load_factor`` (1.25) times the
  mean (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded
  Loads", 2016; KubeAI's ``meanLoadPercentage`` 125). A hot prefix spills to
  the next replica on the ring, always the same next one, so the spill is
  cached too. A replica that is excluded (it refused this request's
  connection) or at its slot limit is passed over; when every one is, the
  caller falls back to least-outstanding (which then finds none with room,
  and the request queues, :mod:`router.admission`).

Rings are built once per set of endpoints (the table swaps the whole tuple
when it changes) and cached, a bounded number of them. Pure and synchronous:
unit tests drive it with plain objects.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

DEFAULT_PREFIX_CHARS = 100
DEFAULT_LOAD_FACTOR = 1.25
DEFAULT_REPLICATION = 256
# Endpoint sets whose ring is kept: one per model that serves, a few for its
# recent changes; past this the cache starts over (a rebuild is ~1 ms).
_MAX_RINGS = 1024


class Loaded(Protocol):
    """What :func:`choose` reads of an endpoint (:class:`router.endpoint.Endpoint`)."""

    @property
    def base_url(self) -> str: ...

    @property
    def inflight(self) -> int: ...

    @property
    def others(self) -> int: ...  # other routers' in flight (router.replicaload)


E = TypeVar("E", bound=Loaded)


def hash64(text: str) -> int:
    """A 64-bit hash that is the same in every process (unlike ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def request_prefix(doc: dict[str, Any], chars: int = DEFAULT_PREFIX_CHARS) -> str | None:
    """The routing key of an OpenAI request body: the first ``chars`` characters of
    its first user message (chat; text parts of a content list joined) or of its
    prompt (completions: a string, or the first of a list of strings). ``None``
    when there is no such text."""
    messages = doc.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict) and message.get("role") == "user":
                return _text(message.get("content"), chars)
        return None
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    return _text(prompt, chars)


def _text(content: object, chars: int) -> str | None:
    if isinstance(content, list):
        content = "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    if isinstance(content, str) and content:
        return content[:chars]
    return None


class Ring:
    """The hash ring of one set of endpoints: ``replication`` points each."""

    __slots__ = ("_hashes", "_owners")

    def __init__(self, endpoints: Sequence[Loaded], replication: int) -> None:
        points = sorted(
            (hash64(f"{endpoint.base_url}#{i}"), index)
            for index, endpoint in enumerate(endpoints)
            for i in range(replication)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [index for _, index in points]

    def walk(self, key_hash: int) -> list[int]:
        """Endpoint indexes in ring order from ``key_hash``, each once."""
        start = bisect.bisect_left(self._hashes, key_hash)
        order: list[int] = []
        seen: set[int] = set()
        n = len(self._owners)
        for i in range(n):
            owner = self._owners[(start + i) % n]
            if owner not in seen:
                seen.add(owner)
                order.append(owner)
        return order


class PrefixChooser:
    """Consistent hashing with bounded loads over a model's endpoints."""

    def __init__(
        self,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        replication: int = DEFAULT_REPLICATION,
        prefix_chars: int = DEFAULT_PREFIX_CHARS,
    ) -> None:
        if load_factor < 1.0 or replication < 1 or prefix_chars < 1:
            raise ValueError(
                "the load factor must be >= 1, the replication and the prefix length >= 1"
            )
        self.prefix_chars = prefix_chars
        self.load_factor = load_factor
        self.replication = replication
        self._rings: dict[tuple[Any, ...], Ring] = {}
        # Walk orders of recent keys per ring: a conversation's turns repeat its key.
        self._walks: dict[tuple[int, int], list[int]] = {}

    def key(self, doc: dict[str, Any]) -> str | None:
        """This request's routing key (:func:`request_prefix`), or ``None``."""
        return request_prefix(doc, self.prefix_chars)

    def bound(self, endpoints: Sequence[Loaded]) -> int:
        """Most requests in flight one endpoint may have, this one counted:
        ceil(load_factor * (in flight + 1) / endpoints), in flight being every
        router's (this one's, and the others' as the replicas reported them)."""
        total = sum(e.inflight + e.others for e in endpoints) + 1
        return math.ceil(self.load_factor * total / len(endpoints))

    def choose(self, endpoints: Sequence[E], key: str, usable: Callable[[E], bool]) -> E | None:
        """The first endpoint on the ring from ``key`` that is ``usable`` (not excluded,
        a free slot) and under the load bound; ``None`` when none is."""
        if not endpoints:
            return None
        ring = self._rings.get(tuple(endpoints))  # type: ignore[arg-type]
        if ring is None:
            if len(self._rings) >= _MAX_RINGS:
                self._rings.clear()
                self._walks.clear()
            ring = self._rings[tuple(endpoints)] = Ring(endpoints, self.replication)  # type: ignore[arg-type]
        key_hash = hash64(key)
        walk_key = (id(ring), key_hash)
        order = self._walks.get(walk_key)
        if order is None:
            if len(self._walks) >= _MAX_RINGS * 4:
                self._walks.clear()
            order = self._walks[walk_key] = ring.walk(key_hash)
        bound = self.bound(endpoints)
        for index in order:
            endpoint = endpoints[index]
            if endpoint.inflight + endpoint.others < bound and usable(endpoint):
                return endpoint
        return None
