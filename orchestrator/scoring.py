"""kv_aware: which replica of a pool serves a request, from small filters and weighted scorers.

Modelled on llm-d's scheduler: filters drop replicas that must not get the request, scorers
give each remaining replica a score between 0 and 1, and the replica with the highest
weighted sum wins (ties: `rank`). The weights are `routing.scorers` in the config; a new
scorer is one function in SCORERS and one field there.

The default weighs one scorer, `work`: the prompt tokens a replica has yet to compute before
this request's first token, those of the requests queued on it plus this request's own not
in its prefix cache, a token it would load (from the CPU tier, or a decode replica's over
NIXL) costing `routing.kv_load_cost` of one computed. A prefix holder wins while its queue is
shorter than what its cache saves. On a decode replica the queue is the KV its requests hold
(every decode step reads it), so decode replicas balance on load first. Summing a prefix
share and a load score (llm-d's way, still a config away) piled chats onto their holders
with the CPU tier on, where a missing prefix is a cheap load and the holder's queue is all
that differs (docs/bench-results.md, routing run 4). Dynamo's KV router weighs the same two
quantities in one cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from orchestrator.config import RoutingConfig, ScorerWeights


class EngineFacts(msgspec.Struct, frozen=True):
    """What the router knows of one replica for one request."""

    engine_id: str
    # Requests in flight on the replica (the larger of this router's count and the engine's).
    outstanding: int
    # Prompt tokens in the replica's own prefix cache, from the first.
    cached_tokens: int
    # Prompt tokens beyond the cached ones that the replica would load rather than compute:
    # from the CPU tier (blocks on other nodes counted half), or, for a decode replica, the
    # prefill's over NIXL.
    loaded_tokens: float
    kv_cache_usage: float
    # Prompt tokens the replica has yet to compute for the requests in flight on it (a decode
    # replica: the KV they hold, which each of its steps reads), this router's estimates made
    # when it sent them, other routers' requests counted at this request's size.
    queued_tokens: float = 0.0
    # Prompt tokens of other prefixes the replica would evict from its full prefix cache to
    # store this prompt's new blocks (CacheView.evicted_tokens).
    evicted_tokens: float = 0.0
    # Whether an evicted prefix comes back as a load: the replica saved it to the CPU tier
    # and loads from it.
    evictions_reload: bool = False
    # Tokens of room for this prompt's new blocks the replica lacks against the roomiest
    # candidate: its cache holds more of other prefixes that traffic keeps reusing
    # (CacheView.room_blocks). A prefix placed there grows with its next requests (a chat's
    # history), and the fuller cache is the first to evict a live prefix, which its next
    # request computes again.
    crowded_tokens: float = 0.0
    # Decode engines with requests in flight whose forward passes or processes run on the
    # replica's cores (EngineRef.steps_beside; none on GPUs): they step with every token and
    # take turns with the replica's forward passes there, which stretches its prefill
    # (1.2-1.6x a prompt token on a 2-core host, docs/bench-results.md, runs 122 and 124;
    # `ahead_tokens`).
    decoding_neighbours: int = 0
    # Those of them whose forward passes run on the replica's cores, not only their processes:
    # the heavier neighbour (0.33 against 0.26 ms a prompt token beside the processes,
    # docs/bench-results.md run 122), which `ahead_tokens` prices higher and `rank` breaks
    # exact ties on.
    computing_neighbours: int = 0
    # The replica's time per prompt token over the fastest candidate's, and its fixed time per
    # prefill beyond the least one's in the fastest's tokens, as the router learned them from
    # the prefills it timed there (orchestrator.speed); None until it has: then the decode
    # engines beside it price it (`ahead_tokens`).
    slowdown: float | None = None
    delay_tokens: float = 0.0


Scorer = Callable[[EngineFacts, int, RoutingConfig], float]
Filter = Callable[[EngineFacts, RoutingConfig], bool]


def new_tokens(prompt_tokens: int, cached_tokens: float, loaded_tokens: float, kv_load_cost: float) -> float:
    """Prompt tokens an engine computes for a request, in computed-token units: those not in
    its prefix cache, the loaded ones counting `kv_load_cost` each; at least one (vLLM always
    computes the last)."""
    return max(1.0, prompt_tokens - cached_tokens - (1.0 - kv_load_cost) * loaded_tokens)


def _share(tokens: float, prompt_tokens: int) -> float:
    return min(1.0, tokens / prompt_tokens) if prompt_tokens > 0 else 0.0


# How much longer a replica computes a prompt token while a decode engine decodes beside it,
# over the same replica alone: beside the decode engine's forward passes (its compute cores)
# 1.6x, beside only its processes (the actor, vLLM's front end, the token path) 1.2-1.4x
# (docs/bench-results.md, runs 122 and 124: 0.326 against 0.204 ms, 0.259 against 0.212,
# 0.267 against 0.188). None on GPUs, where no engine's cores overlap another's.
BESIDE_FORWARD_PASSES = 0.6
BESIDE_PROCESSES = 0.3


def queue_tokens(f: EngineFacts, n: int, cfg: RoutingConfig) -> float:
    """The prompt tokens the replica has to compute before the first token of a request of
    `n` prompt tokens: those queued on it, then the request's own (`new_tokens`)."""
    return f.queued_tokens + new_tokens(n, f.cached_tokens, f.loaded_tokens, cfg.kv_load_cost)


def ahead_tokens(f: EngineFacts, n: int, cfg: RoutingConfig) -> float:
    """`queue_tokens` in the time the fastest candidate takes to compute a token: times the
    replica's learned `slowdown` plus its learned `delay_tokens`, or until they are learned,
    stretched for each decode engine decoding beside it, by its forward passes or only its
    processes. Between replicas of one pool only their cores differ (the request's way to them
    and its KV's from them are alike), so their speeds apply; the disaggregation decider,
    which sets a replica against the decode engine itself, prices them its own way."""
    if f.slowdown is not None:
        return queue_tokens(f, n, cfg) * f.slowdown + f.delay_tokens
    processes = f.decoding_neighbours - f.computing_neighbours
    return queue_tokens(f, n, cfg) * (1 + BESIDE_FORWARD_PASSES * f.computing_neighbours + BESIDE_PROCESSES * processes)


def _work(f: EngineFacts, n: int, cfg: RoutingConfig) -> float:
    """1 / (1 + the tokens ahead of this request's first token, in prompts of its size), the
    tokens its blocks would evict (and so someone computes again) and the room for live
    prefixes it lacks against the roomiest replica (what it will evict first) counting
    `evict_cost`, or `kv_load_cost` where the CPU tier keeps them (someone loads them again)."""
    evict = min(cfg.evict_cost, cfg.kv_load_cost) if f.evictions_reload else cfg.evict_cost
    ahead = ahead_tokens(f, n, cfg) + evict * (f.evicted_tokens + f.crowded_tokens)
    return 1.0 / (1.0 + ahead / max(n, 1))


SCORERS: dict[str, Scorer] = {
    "work": _work,
    "prefix": lambda f, n, cfg: _share(f.cached_tokens, n),
    "tier": lambda f, n, cfg: _share(f.loaded_tokens, n),
    "load": lambda f, n, cfg: 1.0 / (1.0 + f.outstanding),
    "kv_free": lambda f, n, cfg: max(0.0, 1.0 - f.kv_cache_usage),
}
assert set(SCORERS) == set(ScorerWeights.__struct_fields__), "every scorer has a weight"

FILTERS: dict[str, Filter] = {
    # A replica whose KV cache is nearly full would preempt or queue the request.
    "kv_headroom": lambda f, cfg: f.kv_cache_usage < cfg.max_kv_usage,
}


def score(facts: EngineFacts, prompt_tokens: int, cfg: RoutingConfig) -> float:
    weights = cfg.scorers
    return sum(w * fn(facts, prompt_tokens, cfg) for name, fn in SCORERS.items() if (w := getattr(weights, name)))


def rank(candidates: Sequence[EngineFacts], prompt_tokens: int,
         cfg: RoutingConfig) -> tuple[EngineFacts | None, dict[str, float]]:
    """The best candidate (or None) and every candidate's score by engine id, each scored once
    (the router logs them with the request). Ties go to the replica with fewer decode engines
    computing on its cores (`computing_neighbours`: with one decoding beside each, two replicas
    score alike, but the one beside its forward passes rather than its processes computes a
    prompt token 1.25x slower, docs/bench-results.md run 122), then to the one with fewer
    requests in flight; exact ties rotate (`candidates` come in round-robin order)."""
    scores = {f.engine_id: score(f, prompt_tokens, cfg) for f in candidates}
    kept = list(candidates)
    for keep in FILTERS.values():
        kept = [f for f in kept if keep(f, cfg)] or kept  # a filter never leaves no one
    if not kept:
        return None, scores
    best = max(kept, key=lambda f: (round(scores[f.engine_id], 9), -f.computing_neighbours, -f.outstanding))
    return best, scores


def tier_tokens(by_node: dict[str, int], node_id: str, cached_blocks: int, block_size: int) -> float:
    """Prompt tokens the CPU tier adds to an engine's own `cached_blocks`: the tier's run of
    the prompt's blocks (`by_node`: counted by the node of the store holding them) beyond the
    engine's, a block on another node counting half (a cross-node read costs more)."""
    total = sum(by_node.values())
    beyond = total - cached_blocks
    if beyond <= 0:
        return 0.0
    local = by_node.get(node_id, 0)
    return beyond * (local + 0.5 * (total - local)) / total * block_size
