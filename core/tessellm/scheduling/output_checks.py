"""The scheduler's checks that a step's output matches its state (tessellm.scheduler): each
raises SchedulerError before anything changes. `get_request(id)` is the scheduler's lookup
(None for an unknown or finished-and-forgotten request)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from tessellm.request import Request, RequestStatus
from tessellm.scheduling.output import ScheduledRequest, SchedulerError, SchedulerOutput

GetRequest = Callable[[str], "Request | None"]


def check_running(get_request: GetRequest, s: ScheduledRequest) -> None:
    """A scheduled entry may be committed: its request is still the scheduler's and running
    (or finished since: skipped), and the entry was not committed before."""
    request = s.request
    rid = request.request_id
    if request.is_finished:
        return
    if get_request(rid) is not request or request.status is not RequestStatus.RUNNING:
        raise SchedulerError(f"scheduled request {rid!r} is not running")
    done = request.num_computed_tokens + s.num_real_tokens
    if done > request.num_tokens or s.start >= 0:
        raise SchedulerError(
            f"request {rid!r} would have {done} computed tokens out of "
            f"{request.num_tokens}; was this output applied twice?")


def check_output(get_request: GetRequest, output: SchedulerOutput,
                 sampled: dict[str, int]) -> None:
    """update_from_output's check (before commit): one token for each request that becomes
    fully computed and each sibling forking from it, none for partial chunks or others."""
    ids: set[str] = set()
    for s in output.scheduled:
        request = s.request
        rid = request.request_id
        ids.add(rid)
        if request.is_finished:
            continue
        check_running(get_request, s)
        done = request.num_computed_tokens + s.num_real_tokens
        if done == request.num_tokens and rid not in sampled:
            raise SchedulerError(f"request {rid!r} is fully computed but has no sampled token")
        if done < request.num_tokens and rid in sampled:
            raise SchedulerError(
                f"request {rid!r} computed a partial chunk ({done} of "
                f"{request.num_tokens} tokens) and must not sample")
    for pid, children in output.forks.items():
        parent = get_request(pid)
        for child in children:
            ids.add(child.request_id)
            if parent is not None and not parent.is_finished \
                    and not child.is_finished and child.request_id not in sampled:
                raise SchedulerError(f"forked request {child.request_id!r} has no sampled "
                                     f"token")
    extra = sampled.keys() - ids
    if extra:
        raise SchedulerError(f"sampled tokens for requests not in this step: {sorted(extra)}")


def check_samples(get_request: GetRequest, output: SchedulerOutput,
                  sampled: dict[str, int]) -> None:
    """complete()'s check (after commit): a token for each id in output.sampling whose
    request is still unfinished, and none for any other request."""
    extra = sampled.keys() - set(output.sampling)
    if extra:
        raise SchedulerError(f"sampled tokens for requests that do not sample in this "
                             f"step: {sorted(extra)}")
    for rid in output.sampling:
        r = get_request(rid)
        if rid not in sampled and r is not None and not r.is_finished:
            raise SchedulerError(f"request {rid!r} is fully computed but has no sampled "
                                 "token")


def check_accepted(output: SchedulerOutput, accepted: dict[str, Sequence[int]] | None) -> None:
    """Accepted drafts only for entries scheduled with drafts, each a prefix of them."""
    if not accepted:
        return
    drafts = {s.request.request_id: s.draft_token_ids for s in output.scheduled}
    for rid, tokens in accepted.items():
        proposed = drafts.get(rid)
        if proposed is None or tuple(tokens) != proposed[:len(tokens)]:
            raise SchedulerError(f"accepted drafts {list(tokens)} of request {rid!r} are not "
                                 f"a prefix of its scheduled drafts {list(proposed or ())}")
