"""Decode calls timed many to a jitted program, and one to a program.

A decode step takes tens of microseconds on a GPU, about what one call of
a jitted function costs its host: timed one call a program, a step
measures the dispatch, not the kernel. `program` puts `calls` calls of a
function in one jitted program, and `time_in_turn` times such programs in
turn (`testing.time_calls`), so that every ratio of two of them is of
interleaved runs, with each function's one-call program beside them when
`calls` is more than one. decode_benchmark.py's grid and its cache forms
(`bench.decode_forms`) both time their cells this way.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_fa import api
from pallas_fa import testing


def default_calls() -> int:
  """Calls of a cell per timed program: 20 on an accelerator, 1 on a CPU.

  A decode step takes tens of microseconds on a GPU, about what one call
  of a jitted function costs its host (the first H200 run's bfloat16,
  int8 and float8 cells all took 55 us, its latent ones 60-66 us, whatever
  their bytes): timed one call at a time, a cell measures the dispatch.
  Twenty calls in one program keep the device busy while the host
  dispatches the next; a CPU's calls cost far more than their dispatch.
  """
  return 1 if api.platform() == "cpu" else 20


def program(fn: Callable, calls: int) -> Callable:
  """`fn` called `calls` times in one jitted program, the sum of its
  results (in float32) returned; `fn` itself for one call.

  Each call's lengths (the fourth argument) pass through a `minimum` with
  a different bound past any length, a no-op XLA cannot fold, so that no
  two calls are the same computation (one would be dropped).
  """
  if calls == 1:
    return fn
  bound = jnp.iinfo(jnp.int32).max

  def run(*args):
    total = 0
    for i in range(calls):
      lengths = jnp.minimum(args[3], bound - i)
      total += fn(*args[:3], lengths, *args[4:]).astype(jnp.float32)
    return total

  return jax.jit(run)


def time_in_turn(timed: Sequence[tuple[Callable, Callable, tuple]],
                 calls: int, repeats: int) -> list[dict[str, Any]]:
  """Times each `(program(fn, calls), fn, args)` of `timed` in turn.

  The programs are best called once before (a first call compiles; one
  that raises is then the caller's to report, not this run's). With more
  than one call a program, each `fn` alone is timed in the same turns.

  Returns:
    For each entry, its row's timing fields: "ms" per call (the program's
    time / `calls`), "calls_per_program", and with more than one call,
    "ms_one_call" (one call a program, its dispatch included).
  """
  runs = [(prog, args) for prog, _, args in timed]
  if calls > 1:
    runs += [(fn, args) for _, fn, args in timed]
  timings = testing.time_calls(runs, repeats=repeats)
  rows = [dict(ms=timing.ms / calls, calls_per_program=calls)
          for timing in timings[:len(timed)]]
  for row, timing in zip(rows, timings[len(timed):]):
    row["ms_one_call"] = timing.ms
  return rows
