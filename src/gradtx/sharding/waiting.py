"""Bounded waits on collectives, and the one all-reduce that carries its callers' flags.

A rank that runs a reduction the others never run (one call of ``update`` too many) would wait in
it until the process group times out (30 minutes on gloo by default), with a message about
sockets. gradtx waits for its CPU collectives with a bound instead (``ShardingSpec(timeout=...)``,
600 s by default) and says what happened. On a GPU the host never waits on a collective, so
nothing is bounded there.

``Work.wait(timeout)`` on a gloo collective (torch 2.13) raises ``RuntimeError("Operation timed
out!")`` once the bound passes, but does not cancel the operation: it stays pending and matches the
next collective the other ranks start on that group. The process group cannot be trusted after
that, and the error says to stop the run.

:func:`all_reduce` is the reduction a step makes anyway (the global norm's), carrying in the same
buffer, so steady-state steps make no other collective:

- an **error bit**: a rank that failed while computing its share still joins, with a zero share and
  the bit set; then every rank of the group raises the same error, naming the rank and the leaf
  (one more collective gathers the message, on that path only);
- its **call count** ``c`` (modulo 64): ranks at different counts are out of step (one of them ran
  the reduction more often), and every rank raises, naming each rank's count.

Both ride in as few elements as possible, since a gloo all-reduce of a few elements costs more per
element than the elements themselves (at 2 ranks, measured: 1 element 290 us, 2 elements 340 us, 4
elements 520 us). Under SUM, **one** element ``c + K c^2`` (``K = 64 n`` for ``n`` ranks) sums to
``sum(c) + K sum(c^2)``, both read back exactly (float64 integers below 2^53 for groups of up to
185,000 ranks), and ``n sum(c^2) == sum(c)^2`` exactly when every ``c`` is equal; a failed rank
sends ``-2^60`` instead, so a negative sum means some rank failed. Under MAX (``p = inf``), two
elements: ``c`` (``2^60`` for a failed rank) and ``-c``, whose maxima are the largest and the
smallest count.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

_COUNT_MODULUS = 64
_FAILED = 2.0**60
_FLAG_DTYPE = torch.float64


def wait(work: Any, buffer: Tensor, timeout: Optional[float]) -> None:
    """Waits for ``work`` (the collective on ``buffer``), for at most ``timeout`` seconds on a CPU
    buffer; raises ``RuntimeError`` when the bound or the process group's own timeout passes."""
    if timeout is None or buffer.device.type != "cpu":
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=timeout))


def all_reduce(
    values: Tensor,
    op: Any,
    group: Any,
    *,
    what: str,
    calls: dict[str, int],
    error: Optional[BaseException],
    timeout: Optional[float],
) -> Tensor:
    """``values`` (1-D float64) all-reduced with ``op`` (SUM or MAX) over ``group``, with the error
    bit and the call count of ``what`` (counted in ``calls``) in the same buffer; raises on every
    rank when a rank set its error bit (its ``error``) or the ranks' counts differ."""
    if torch.compiler.is_compiling():
        dist.all_reduce(values, op=op, group=group)
        return values
    count = calls.get(what, 0) + 1
    calls[what] = count
    c = count % _COUNT_MODULUS
    size = dist.get_world_size(group)
    is_max = op == dist.ReduceOp.MAX
    if is_max:
        tail = [_FAILED if error is not None else float(c), -float(c)]
    else:
        tail = [-_FAILED if error is not None else float(c + _COUNT_MODULUS * size * c * c)]
    buffer = torch.cat([values.to(_FLAG_DTYPE), torch.tensor(tail, dtype=_FLAG_DTYPE, device=values.device)])
    try:
        wait(dist.all_reduce(buffer, op=op, group=group, async_op=True), buffer, timeout)
    except RuntimeError as failure:
        raise RuntimeError(_waited(what, count, group, timeout, failure)) from (error or failure)
    reduced = buffer[-len(tail) :].tolist()
    if (reduced[0] >= _FAILED) if is_max else (reduced[0] < 0):
        _raise_everywhere(what, error, group)
    if is_max:
        in_step = reduced[0] == -reduced[1]
    else:
        total = int(reduced[0])
        sum_c = total % (_COUNT_MODULUS * size)
        sum_c2 = (total - sum_c) // (_COUNT_MODULUS * size)
        in_step = size * sum_c2 == sum_c * sum_c
    if not in_step:
        _raise_out_of_step(what, count, group, error)
    if error is not None:  # cannot happen (its bit was set); kept so an error is never swallowed
        raise error
    return buffer[: values.numel()]


def all_reduce_bounded(buffer: Tensor, op: Any, group: Any, *, what: str, timeout: Optional[float]) -> None:
    """``dist.all_reduce`` of ``buffer`` in place, waiting at most ``timeout`` seconds on a CPU
    buffer: a reduction without :func:`all_reduce`'s flags (a per-leaf norm, a decision's count),
    which raises the same clear error, naming ``what``, when the other ranks do not join."""
    if torch.compiler.is_compiling():
        dist.all_reduce(buffer, op=op, group=group)
        return
    try:
        wait(dist.all_reduce(buffer, op=op, group=group, async_op=True), buffer, timeout)
    except RuntimeError as failure:
        raise RuntimeError(_waited(what, None, group, timeout, failure)) from failure


def _waited(what: str, count: Optional[int], group: Any, timeout: Optional[float], failure: BaseException) -> str:
    ranks = dist.get_process_group_ranks(group)
    if count is None:
        call, before = f"its call of {what}", "it may have run it more often than they did"
    else:
        call = f"its call {count} of {what}"
        before = (
            f"they completed call {count - 1} with it" if count > 1 else "no call of it has completed on every rank yet"
        )
    bound = f"{timeout:g} s" if timeout is not None else "the process group's timeout"
    return (
        f"gradtx.sharding: rank {dist.get_rank()} waited {bound} in {call} for the other "
        f"ranks of its group (ranks {ranks}), which did not join ({failure}); {before}. A rank that runs a "
        "sharded update more times than the others waits like this: call update the same number of times on "
        "every rank (skip a step with apply_if_finite or MultiSteps, not by skipping the call). This rank's "
        "all-reduce stays pending in the process group, so stop the run. The bound is "
        "ShardingSpec(..., timeout=seconds)."
    )


def _raise_everywhere(what: str, error: Optional[BaseException], group: Any) -> None:
    """Every rank of ``group`` raises the first failed rank's error (a second collective, error path only)."""
    mine = None if error is None else (dist.get_rank(), type(error).__name__, str(error))
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, mine, group=group)
    failed = [r for r in reports if r is not None]
    rank, kind, message = failed[0]
    others = f" (and on {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    cls = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)
    raise cls(f"gradtx.sharding: rank {rank} cannot run {what}{others}: {message}") from error


def _raise_out_of_step(what: str, count: int, group: Any, error: Optional[BaseException]) -> None:
    counts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(counts, (dist.get_rank(), count), group=group)
    listed = ", ".join(f"rank {rank} at call {c}" for rank, c in sorted(counts))
    raise RuntimeError(
        f"gradtx.sharding: the ranks ran {what} a different number of times ({listed}), so this reduction "
        "mixed different steps and its result is meaningless: call update (and every sharded reduction) the "
        "same number of times on every rank"
    ) from error
