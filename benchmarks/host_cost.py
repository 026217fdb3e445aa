"""The host's share of a training step, measured on a CPU: vitscale's step at ZeRO 0-3 beside the hand-written loop.

    python benchmarks/host_cost.py [--zero-stages 0 1 2 3] [--width 48] [--steps 20] [--per-layer-hooks] [--compile]

A GPU step runs at the GPU's speed only when the host queues its kernels faster than the GPU runs them and
never waits for the GPU in between. Both are properties of the host's side, so both can be measured without
a GPU, and so can the number of operators the update dispatches (a kernel launch each on a GPU, queued by
Python one after the other while the GPU waits for the update). The model has ViT-B/16's layout (12 blocks,
152 parameter tensors, 12 heads, 16-px patches) at a width of 48 on 32-px images, so that a phase's time is
the Python, hook and dispatch work of the step rather than its arithmetic; and every time the host would wait
for a GPU is counted, per phase and per step: a read of a tensor on the host (`item`, `tolist`, a tensor's
truth value or float) and a device sync DeepSpeed asks of its accelerator (`get_accelerator().synchronize()`,
a no-op here, the whole queue drained on a GPU).

vitscale's side runs the path a GPU trains on (`benchmarks/mfu.py`'s `VitscaleStep`): bf16, torch's fused
optimizer (its CPU kernel here), DeepSpeed's engine at each ZeRO stage, the worker's own `Stepper`; eager,
as compiling changes the kernels, not the host's bookkeeping around them; `--compile` compiles the model in
every loop (inductor, this CPU's kernels; vitscale's update then its one pass), as a GPU trains: what is left
of the host's time once the model's own Python is gone, DeepSpeed's hooks and the update mostly. The peer
(`PeerStep`): the same model, bf16 autocast, fused AdamW, no clipping, one process, no DeepSpeed. At one
rank, vitscale's ZeRO 3 keeps its parameters whole (`train/one_rank.py`); at ZeRO 1-3 (eager) a second row
steps with the update a GPU runs compiled (`train/one_pass.py`, its kernel compiled here too);
`--per-layer-hooks` adds ZeRO 3 gathering them as it must on many ranks, a block at a time (vitscale's
hooks) and a layer at a time (DeepSpeed's own), and every ZeRO 3 row counts the parameters gathered per step.

One thread, so that the figures do not depend on how many cores the machine lends. Targets (the GPU's,
`benchmarks/mfu.py`): ZeRO 0-2 waiting for the device once per step; ZeRO 3's host time within 15% of
ZeRO 1's where it is hidden under the GPU's.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mfu import PeerStep, VitscaleStep, _init_process_group, _phases, _time_steps
from vitscale.train.one_pass import one_pass_update

LAYOUT = "ViT-B/16"
ONE_PASS_LABEL = "vitscale, one-pass update"
READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__"})
"""Tensor methods that bring a value to the host: a device sync each on a GPU."""


class HostWaits(TorchFunctionMode):
    """Counts, inside it, the tensor-to-host reads and the device syncs asked of DeepSpeed's accelerator."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in READS:
            self.waits.append(func.__name__)
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostWaits:
        from deepspeed.accelerator import get_accelerator

        self._accelerator = get_accelerator()
        self._synchronize = self._accelerator.synchronize

        def synchronize(*args: Any, **kwargs: Any) -> Any:
            self.waits.append("synchronize")
            return self._synchronize(*args, **kwargs)

        self._accelerator.synchronize = synchronize
        # On one rank ZeRO 3's gather hands back a view of the partition, and its handle's wait synchronises
        # the device's stream where the accelerator does not resolve data dependencies (CUDA; a CPU does).
        from deepspeed.runtime.zero import partition_parameters as zero

        self._handles = {cls: cls.wait for cls in (zero.NoGatherHandle, zero.NoGatherCoalescedHandle)}
        for cls, wait in self._handles.items():
            done = f"_{cls.__name__}__complete"

            def counted(handle: Any, *args: Any, _wait: Any = wait, _done: str = done, **kwargs: Any) -> Any:
                if not getattr(handle, _done):
                    self.waits.append("gather")
                return _wait(handle, *args, **kwargs)

            cls.wait = counted  # type: ignore[method-assign]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._accelerator.synchronize = self._synchronize
        for cls, wait in self._handles.items():
            cls.wait = wait  # type: ignore[method-assign]


def count_gathers(call: Callable[[], Any]) -> int:
    """How many parameters ZeRO 3's hooks gather during one `call()` (a copy each on many ranks, a view on
    one; on a GPU each gather handle is waited on, `HostWaits`'s "gather")."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator

    name = "_PartitionedParameterCoordinator__all_gather_params_"
    gather, gathered = getattr(Coordinator, name), []

    def counted(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        gathered.append(len(params))
        return gather(self, params, *args, **kwargs)

    setattr(Coordinator, name, counted)
    try:
        call()
    finally:
        setattr(Coordinator, name, gather)
    return sum(gathered)


def count_waits(call: Callable[[], Any]) -> int:
    """How many times one `call()` would make the host wait for a GPU."""
    with HostWaits() as counted:
        call()
    return len(counted.waits)


def count_update_ops(run: Any) -> int:
    """How many operators `run`'s update (after its forward and backward) dispatches that touch a tensor's data
    (a kernel launch each on a GPU, queued one by one): the outermost `aten::` calls, less views, detaches and
    the like, which launch nothing. The profiler's count, the same on any device."""
    from torch.profiler import ProfilerActivity, profile

    forward, backward, update = run.phases()
    forward()
    backward()
    with profile(activities=[ProfilerActivity.CPU]) as traced:
        update()
    outermost = [e for e in traced.events() if e.name.startswith("aten::")
                 and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return sum(e.name.removeprefix("aten::") not in NO_KERNEL for e in outermost)


NO_KERNEL = frozenset({"view", "reshape", "detach", "as_strided", "slice", "narrow", "select", "unsqueeze",
                       "squeeze", "t", "transpose", "permute", "expand", "alias", "empty", "empty_like",
                       "empty_strided", "_has_compatible_shallow_copy_type", "set_", "lift_fresh", "to", "_to_copy",
                       "resolve_conj", "resolve_neg", "is_nonzero", "item", "_local_scalar_dense"})
"""Operators that launch no kernel of their own: views and metadata, and `to` (whose copy, where there is one,
is counted as its `copy_`)."""


def measure(label: str, run: Any, *, steps: int, zero_stage: int | None) -> dict[str, Any]:
    """Median step and phase times (ms) of `run` (a `VitscaleStep` or `PeerStep`) and its waits per phase."""
    step_ms = 1e3 * _time_steps(run.step, steps, torch.device("cpu"))
    phases = _phases(run.phases(), torch.device("cpu"), repeats=max(5, steps // 2))
    waits = [count_waits(phase) for phase in run.phases()]
    return {"loop": label, "zero_stage": zero_stage, "step_ms": step_ms, **phases,
            "waits_per_step": count_waits(run.step), "waits_forward": waits[0], "waits_backward": waits[1],
            "waits_update": waits[2], "gathers_per_step": count_gathers(run.step),
            "update_ops": count_update_ops(run)}


def table(rows: list[dict[str, Any]]) -> list[str]:
    peer = next((r["step_ms"] for r in rows if r["zero_stage"] is None), None)
    lines = ["| loop | ZeRO | step ms | vs peer | forward ms | backward ms | update ms | waits for the device per "
             "step (forward / backward / update) | parameters gathered per step | operators launched by the "
             "update |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['step_ms'] / peer:.2f}x" if peer else "-"
        stage = "" if r["zero_stage"] is None else str(r["zero_stage"])
        lines.append(f"| {r['loop']} | {stage} | {r['step_ms']:.2f} | {ratio} | {r['forward_ms']:.2f} | "
                     f"{r['backward_ms']:.2f} | {r['optimizer_ms']:.2f} | {r['waits_per_step']} "
                     f"({r['waits_forward']} / {r['waits_backward']} / {r['waits_update']}) | "
                     f"{r['gathers_per_step'] if r['zero_stage'] == 3 else ''} | {r['update_ops']} |")
    return lines


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--zero-stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3],
                        help="ZeRO stages of vitscale's step to measure")
    parser.add_argument("--width", type=int, default=48, help="the model's width (a multiple of its 12 heads)")
    parser.add_argument("--batch", type=int, default=2, help="images per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement (after 3 warm-up)")
    parser.add_argument("--per-layer-hooks", action="store_true",
                        help="also ZeRO 3 gathering its parameters block by block, and layer by layer (DeepSpeed's "
                             "default), as it does on many ranks")
    parser.add_argument("--compile", action="store_true",
                        help="compile the model (inductor, this CPU's kernels) in every loop, as a GPU trains: the "
                             "host's share of a compiled step, where the model's own Python is gone")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON document at the end")
    args = parser.parse_args(argv)
    if args.width % 12:
        parser.error(f"--width {args.width}: must be a multiple of the layout's 12 heads")

    torch.set_num_threads(1)
    _init_process_group()
    options = {"width": args.width, "mlp_dim": 2 * args.width}
    shape = {"batch": args.batch, "img_size": 32, "options": options}
    rows = [measure("peer: hand-written", PeerStep(LAYOUT, device=torch.device("cpu"), timm_model=False,
                                                   compile_model=args.compile, bf16=True, fused=True, **shape),
                    steps=args.steps, zero_stage=None)]
    plans: list[tuple[str, int, dict[str, Any]]] = [("vitscale", stage, {}) for stage in args.zero_stages]
    # ZeRO 1-3's update as a GPU runs it, its kernels compiled (`train/one_pass.py`; the model stays eager).
    # Compiled, the engine installs it itself, as a GPU worker's does: the "vitscale" rows already run it.
    plans += [(ONE_PASS_LABEL, stage, {}) for stage in args.zero_stages if stage >= 1 and not args.compile]
    if args.per_layer_hooks:
        # Every parameter gathered, as ViT-B/16's weight matrices are at its own width on many ranks: at this
        # width all of them are under DeepSpeed's default threshold (100,000 elements) and would persist.
        gathered = {"stage3_param_persistence_threshold": 0, "memory_efficient_linear": True}
        plans.append(("vitscale, gathered block by block (as on many ranks)", 3, {"zero_optimization": gathered}))
        plans.append(("vitscale, gathered layer by layer (DeepSpeed's default)", 3,
                      {"zero_optimization": {**gathered, "leaf_module": {"classes": []}}}))
    for label, stage, deepspeed in plans:
        run = VitscaleStep(LAYOUT, zero_stage=stage, device=torch.device("cpu"), compile_model=args.compile,
                           precision="bf16", fused=True, deepspeed=deepspeed, **shape)
        if label == ONE_PASS_LABEL and not one_pass_update(run.engine):
            raise RuntimeError(f"the one-pass update did not install at ZeRO {stage}")
        rows.append(measure(label, run, steps=args.steps, zero_stage=stage))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{LAYOUT}'s layout at width {args.width}, {args.batch} images of 32 px, one CPU thread, "
          f"{'compiled' if args.compile else 'eager'}, median of {args.steps} steps:")
    print("\n".join(table(rows)))
    if args.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
