"""Which prompt rows a step loads into vLLM's paged cache and which it gathers out of it.

Pure arithmetic (no vLLM, no torch), so every case is unit-tested without an engine
(tests/test_vllm_units.py). With prefix caching on (vLLM's default) a request starts with a
*local* hit ``computed`` — whole vLLM blocks vLLM already holds — next to the dualpath hit
``hit`` (docs/vllm.md "Prefix caching"):

* ``computed < hit``: vLLM asks the connector for ``hit - computed`` tokens; only rows
  ``[computed, hit)`` are loaded — the rows vLLM holds are never written over;
* ``computed >= hit``: nothing is loaded (the node's hit is not needed by vLLM);
* on the prefill side the rows the PE forwards and writes back are ``[hit, prompt)``, all of
  them, gathered from the paged cache: rows vLLM computes in this forward and rows it held
  locally (``[hit, computed)``) alike. ``saved`` tracks what was gathered already, so a
  prompt prefilled over several chunks gathers each row once, and a row is never forwarded
  that was not gathered.
"""

from __future__ import annotations

Rows = tuple[int, int]          # [start, stop) of prompt token positions


def step_rows(*, hit: int, saved: int, computed: int, scheduled: int, external: int,
              prompt: int) -> tuple[Rows, Rows]:
    """``(load, save)`` of one step of a request.

    ``computed``: tokens vLLM counts as present at the step's start (local hit + the
    ``external`` tokens the connector is loading in this forward); ``scheduled``: tokens
    computed in this step; ``saved``: rows gathered by earlier steps (0 at first). ``load`` are
    the dualpath rows copied in before each layer computes; ``save`` the rows gathered after
    it (empty on a decode-only step: ``stop <= start``). Every row of ``save`` is in the paged
    cache by then: below ``computed`` it was held or loaded, above it computed in the step.
    """
    if not 0 <= external <= computed:
        raise ValueError(f"external {external} outside the {computed} computed tokens")
    load = (computed - external, computed)
    start = max(saved, hit)
    stop = max(start, min(computed + scheduled, prompt))
    return load, (start, stop)
