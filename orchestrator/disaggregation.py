"""Per request: prefill on the prefill pool and move the KV (remote), or on the decode engine
itself (local)?

A remote prefill pays a second hop and a KV transfer to keep long prefills off the decode
engines, where they would stall every running decode for a step. When the decode engine
already holds most of the prompt (its prefix cache or the CPU tier), the part left is short
and computing it in place is cheaper than the round trip, unless the engine is busy: the
stall is paid by every request it runs, so the budget is the tokens it must compute before
this request's first token (its own uncached ones, plus the local prefills already queued
there) times the requests held up (the new one included). Counting the queue splits a burst
of short turns between the decode engine and the prefill pool instead of stacking all of it
on the one engine. The budget grows by what the best prefill replica would have ahead of
this request beyond the decode engine's part (its own queue, and the prompt tokens it lacks
that the decode engine holds): a chat whose history only the decode engine still caches
(it prefilled the earlier turns) is not sent to compute that history again, while a prompt
both hold alike is judged by the budget alone, and a saturated prefill pool by the same
sum: its queue is in the tokens ahead. Engines given the same cores (three or four engines
on a 2-core host) compute their prompts in turns, so each one's tokens ahead include the
others' queues: a burst of turns is not sent to two engines that would compute it side by
side on one core while another core has less to do (docs/bench-results.md, runs 100-102
and 111-112); and a decode engine decoding on a replica's cores (its forward passes or its
processes) counts that replica's tokens ahead once more, as its steps take turns with the
replica's prefill there (runs 121-125). (A rule that went local whenever every prefill
replica had a few requests in flight, whatever the decode engine ran, was dropped: its count
held requests only waiting for their KV pull, and past saturation it loaded a decode engine
slower still, whose stalled decodes and timed-out prefills put conditional further behind
`always` than the pool alone; docs/bench-results.md, run 68.) When the prefill engine
streams the first token (`routing.first_token: prefill`), a remote prefill's time to first
token is its own queue and uncached part, with no KV move or decode step in it: then a
request goes local only if the decode engine has no more to compute before its first token
than the best prefill replica (ties stay local, sparing the KV move), so local prefills do
not stack on the decode engine while a prefill replica would answer sooner. What the decode
engine would load from the CPU tier counts `routing.kv_load_cost` of a computed token, as
on the prefill side: a load is a wait for the tier and a scheduler step, and a chat a
prefill replica holds in its own cache is not a tie with a decode engine that must load it. A request that asks for its prompt's logprobs (echo with
logprobs, `prompt_logprobs`) is always prefilled where its output streams: vLLM computes them
in the forward pass over the prompt, which a decode engine that pulls the KV never runs.

A local prefill also leaves the prompt on the decode engine alone, which matters for a
conversation: its next turn finds its history there or nowhere. Every request's KV passes
through the decode engine's cache, a prefill replica's only that of the requests sent to it,
so with caches alike the decode engine's turns over first and a history homed there is the
one lost, its next turn computing it whole (docs/bench-results.md, routing runs 44-47). So
the router counts such a loss as `at_risk_tokens` on the local side (Router._stranded_tokens:
a conversation's turn, on a decode engine that keeps no copy in the CPU tier and has no
more to spare than the roomiest prefill replica): the turn then goes remote, where kv_aware
homes it on the prefill pool. A chat's first turn extends no earlier prompt, as a one-off
question after a shared system prompt does, so its loss is counted at the odds that such
prompts (with its first block) were continued lately (CacheView.continuation_rate), 1 until
the router has seen one continued or waited a chat's pause in vain: first turns go remote as
later turns do, and one-off questions, never continued, keep the local path once they are
known for it (docs/bench-results.md, runs 172-174). Counted on /metrics by decision and
reason.
"""

from __future__ import annotations

from typing import Literal

from orchestrator.config import RoutingConfig
from orchestrator.scoring import EngineFacts, new_tokens, queue_tokens

Decision = Literal["remote", "local"]
# always / never: the configured mode; short_uncached: little of the prompt is left to compute
# on the decode engine, for the requests it would hold up; remote_costlier: more, but the
# prefill pool would have more still ahead of it (its queue included); long_uncached: worth
# a remote prefill; prefill_sooner: the prefill replica that streams the first token would
# reach it with less to compute than the decode engine;
# prompt_logprobs: the request needs its prompt computed where its output streams;
# stranded_history: local but for the history it would leave on the decode engine alone.
Reason = Literal["always", "never", "short_uncached", "remote_costlier", "long_uncached", "prefill_sooner",
                 "prompt_logprobs", "stranded_history"]
DECISIONS: tuple[tuple[Decision, Reason], ...] = (
    ("remote", "always"), ("local", "never"), ("local", "short_uncached"), ("local", "remote_costlier"),
    ("remote", "long_uncached"), ("remote", "prefill_sooner"), ("local", "prompt_logprobs"),
    ("remote", "stranded_history"),
)


def remote_ahead_tokens(f: EngineFacts, n: int, cfg: RoutingConfig) -> float:
    """`prefill_ahead_tokens` for replica `f`: its `queue_tokens`, counted once more for each
    decode engine decoding beside it (forward passes or processes). Against the decode
    engine's own prefill, a replica beside its steps computed a prompt token 1.6-2.1x slower
    (0.26-0.33 against 0.16 ms, docs/bench-results.md run 122), and it was this price that
    kept the short chats' tail local (runs 123-125)."""
    return queue_tokens(f, n, cfg) * (1 + f.decoding_neighbours)


def decide(
    cfg: RoutingConfig,
    prompt_tokens: int,
    decode_cached_tokens: float,
    decode_outstanding: int,
    *,
    decode_loaded_tokens: float = 0.0,
    decode_queued_tokens: float = 0.0,
    prefill_ahead_tokens: float | None = None,
    first_from_prefill: bool = False,
    prompt_logprobs: bool = False,
    at_risk_tokens: float = 0.0,
) -> tuple[Decision, Reason]:
    """`decode_cached_tokens`: prompt tokens in the decode engine's prefix cache;
    `decode_loaded_tokens`: those beyond them it would load from the CPU tier, each costing
    `routing.kv_load_cost` of a computed one, as the prefill replicas' do in
    `prefill_ahead_tokens`; `decode_outstanding`: requests in flight there;
    `decode_queued_tokens`: prompt tokens of local prefills sent to the decode engine that it
    has not computed yet, and those queued on engines computing on its cores;
    `prefill_ahead_tokens`: the tokens the best prefill replica would compute before this
    request's first token (its queue, the queues of engines computing on its cores, and this
    prompt's uncached part; None: unknown);
    `first_from_prefill`: a remote prefill would stream this request's first token;
    `at_risk_tokens`: what a local prefill is expected to cost later, in computed tokens (a
    history it would leave where it is likely lost)."""
    if prompt_logprobs:
        return "local", "prompt_logprobs"
    if cfg.disaggregation == "always":
        return "remote", "always"
    if cfg.disaggregation == "never":
        return "local", "never"
    to_compute = new_tokens(prompt_tokens, decode_cached_tokens, decode_loaded_tokens, cfg.kv_load_cost)
    to_compute += decode_queued_tokens
    args = (cfg, decode_outstanding, prefill_ahead_tokens, first_from_prefill)
    if reason := _local(to_compute + at_risk_tokens, *args):
        return "local", reason
    if at_risk_tokens and _local(to_compute, *args):
        return "remote", "stranded_history"
    if first_from_prefill and prefill_ahead_tokens is not None and to_compute > prefill_ahead_tokens:
        return "remote", "prefill_sooner"
    return "remote", "long_uncached"


def _local(to_compute: float, cfg: RoutingConfig, decode_outstanding: int, prefill_ahead_tokens: float | None,
           first_from_prefill: bool) -> Reason | None:
    """Why the decode engine should prefill a request costing it `to_compute` tokens, or None."""
    if first_from_prefill and prefill_ahead_tokens is not None and to_compute > prefill_ahead_tokens:
        return None
    stall = to_compute * (1 + decode_outstanding)
    if stall <= cfg.local_prefill_max_tokens:
        return "short_uncached"
    if prefill_ahead_tokens is not None and stall <= cfg.local_prefill_max_tokens + prefill_ahead_tokens - to_compute:
        return "remote_costlier"
    return None
