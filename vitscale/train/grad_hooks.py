"""ZeRO 1-3's gradient hooks, DeepSpeed 0.19's, without a view of every parameter in each backward pass.

DeepSpeed registers a hook on every parameter (ZeRO 1/2's `create_gradient_handling_hooks`, ZeRO 3's
`create_reduce_and_remove_grad_hooks`) that hands its gradient over and, at the first hook of each backward pass,
counts the parameters that backward pass will reach (`count_used_parameters_in_backward`, which its bookkeeping
for reentrant checkpointing reads). To count, it finds each parameter's gradient accumulator by making a view of
it under grad mode, then asks the autograd engine whether that node will run. For ViT-B/16 that is 152 views and
autograd nodes made and dropped in every backward pass: 0.43 ms of the host's time on this project's 2-core CPU
(2026-12-01), spent inside the first hook, where the autograd thread launches none of the backward pass's
kernels meanwhile. A small ViT's GPU waits for that (ViT-Ti/16's backward pass took 12.1 ms on an H200 against
the hand-written peer's 10.5).

A parameter's gradient accumulator is one node for as long as something holds it: every forward pass's graph
ends in the same node. `count_from_held_accumulators` re-registers each parameter's hook as DeepSpeed's own, op
for op, except that its count asks the engine about accumulators looked up once, when the hooks are made, and
held by those hooks: the same nodes, the same question (`torch._C._will_engine_execute_node`), the same count
(0.02 ms), without the views. Installed only on DeepSpeed's ZeRO 1/2 and ZeRO 3 optimizers whose hooks are the
ones this re-states (one per parameter that requires a gradient, outside ZeRO 3's leaf modules), ZeRO 3 only
where every such parameter is whole (one rank's, `train/one_rank.py`); ZeRO 3's leaf modules keep their own
hooks, and anything else keeps DeepSpeed's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

HELD = "vitscale_held_accumulators"
"""The attribute holding the (parameter, accumulator) pairs of an optimizer whose hooks count from them."""


def count_from_held_accumulators(engine: Any) -> bool:
    """Re-register the gradient hooks of `engine`'s ZeRO optimizer with the count from held accumulators (see the
    module's docstring); whether they were."""
    optimizer: Any = getattr(engine, "optimizer", None)
    stage = _STAGES.get(type(optimizer).__name__)
    if stage is None or not _recognised(optimizer, stage) or HELD in vars(optimizer):
        return False
    groups, method, takes_group = stage
    # ZeRO 3's leaf modules' parameters are handed over by their module's hook, and counted as one each.
    wanted = [(group, p) for group, params in enumerate(getattr(optimizer, groups)) for p in params
              if p.requires_grad and not hasattr(p, "ds_z3_leaf_module")]
    leaves = len(getattr(optimizer, "leaf_parameters", {}))
    handles = optimizer._grad_acc_hooks
    if len(handles) != len(wanted) or not all(hasattr(handle, "remove") for handle in handles):
        return False
    # An accumulator records its parameter's shape when it is made: a ZeRO 3 parameter partitioned over ranks
    # (its data empty until gathered) would make one that every gathered gradient mismatches. Whole ones only.
    if not all(tuple(p.shape) == tuple(getattr(p, "ds_shape", p.shape)) for _, p in wanted):
        return False
    for handle in handles:
        handle.remove()
    handles.clear()
    held = _accumulators([p for _, p in wanted])
    for group, param in wanted:
        handles.append(param.register_post_accumulate_grad_hook(
            _hook(optimizer, _hand_over(optimizer, method, param, group if takes_group else None), held, leaves)))
    setattr(optimizer, HELD, held)
    return True


def used_parameters(held: list[tuple[torch.Tensor, Any]]) -> int:
    """DeepSpeed 0.19's `count_used_parameters_in_backward` over `held`'s (parameter, gradient accumulator) pairs:
    how many distinct accumulators of parameters that require a gradient the running backward pass will reach."""
    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward must be called during backward execution")
    nodes = {id(node): node for param, node in held if param.requires_grad}
    return int(sum(map(torch._C._will_engine_execute_node, nodes.values())))


def _accumulators(params: list[torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
    # `torch.autograd.graph._get_grad_fn_or_grad_acc`'s lookup, once: holding the node keeps it the one every
    # later graph ends in.
    with torch.enable_grad():
        return [(p, p.view_as(p).grad_fn.next_functions[0][0]) for p in params]  # type: ignore[union-attr]


def _hook(optimizer: Any, hand_over: Callable[[], None], held: list[tuple[torch.Tensor, Any]],
          leaves: int) -> Callable[..., None]:
    def grad_handling_hook(*_: Any) -> None:
        # DeepSpeed's hook (ZeRO 1/2's `grad_handling_hook`, ZeRO 3's `reduce_partition_and_remove_grads`, without
        # the NVTX range DeepSpeed wraps ZeRO 3's in), its count from `held`.
        refresh = optimizer.should_refresh_expected_hook_count()  # before the re-entry, as DeepSpeed asks it
        optimizer.reenter_backward_if_needed()
        hand_over()
        expected = used_parameters(held) + leaves if refresh else optimizer._max_expected_hooks_seen
        optimizer.update_hook_state_and_maybe_run_epilogue(expected)

    return grad_handling_hook


def _hand_over(optimizer: Any, method: str, param: torch.Tensor, group: int | None) -> Callable[[], None]:
    # Looked up at each call, as DeepSpeed's hook does (`train/one_rank.py` replaces what the method calls).
    if group is None:
        return lambda: getattr(optimizer, method)(param)
    return lambda: getattr(optimizer, method)(param, group)


_STAGES: dict[str, tuple[str, str, bool]] = {
    "DeepSpeedZeroOptimizer": ("bit16_groups", "process_gradients", True),
    "DeepSpeedZeroOptimizer_Stage3": ("fp16_groups", "reduce_ready_partitions_and_remove_grads", False),
}
"""Per DeepSpeed optimizer class: where its parameter groups are, the method its hook hands a gradient over
with, and whether that method takes the parameter's group."""


def _recognised(optimizer: Any, stage: tuple[str, str, bool]) -> bool:
    """The optimizer has the hooks' list and the methods DeepSpeed 0.19's hook calls, and torch the engine query."""
    groups, method, _ = stage
    return (isinstance(getattr(optimizer, "_grad_acc_hooks", None), list) and hasattr(optimizer, groups)
            and all(callable(getattr(optimizer, name, None)) for name in (
                "should_refresh_expected_hook_count", "reenter_backward_if_needed", method,
                "update_hook_state_and_maybe_run_epilogue"))
            and hasattr(optimizer, "_max_expected_hooks_seen")
            and all(hasattr(torch._C, name) for name in ("_current_graph_task_id", "_will_engine_execute_node")))
