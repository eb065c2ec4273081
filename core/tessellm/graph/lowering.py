"""Lowering: bind every node of a ModelGraph to what runs it, yielding an ExecutionPlan.

Device ops become KernelSites: on the first call in a new token bucket the site asks the
KernelSelector for (op, dtype, bucket, dims) and then calls that kernel for every later call in
the bucket. The attention composite becomes an AttentionSite (cache write, then the decode and
prefill kernels on their parts of the batch). Structural helpers run as they are.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from tessellm.device import Communicator
from tessellm.errors import KernelError
from tessellm.graph import ops
from tessellm.graph.ir import ModelGraph
from tessellm.graph.plan import BindingClock, ExecutionPlan, Instruction, Slot
from tessellm.kernels.attention_metadata import AttentionMetadata
from tessellm.kernels.profiler import KernelSelector, token_bucket
from tessellm.kernels.registry import Kernel, KernelQuery, WeightLayout


class KernelSite:
    """One device-op node; the row count of its first argument picks the token bucket.

    A kernel with a WeightLayout reads this site's weight (argument 1) in its own form,
    prepared once at the first call that needs it; after adopt_weight_layouts the plan no
    longer holds the plain weight and argument 1 arrives as None."""

    __slots__ = ("op", "dtype", "dims", "selector", "per_sequence", "clock", "_by_bucket",
                 "_kernels", "_prepared", "_last_rows", "_last_fn")

    def __init__(self, op: str, dtype: torch.dtype, dims: tuple, selector: KernelSelector,
                 per_sequence: bool = False, clock: BindingClock | None = None) -> None:
        self.op, self.dtype, self.dims, self.selector = op, dtype, dims, selector
        self.per_sequence = per_sequence  # rows are sampled sequences (the LM head), not tokens
        self.clock = clock or BindingClock()   # the plan's: ticked at every binding
        self._by_bucket: dict[int, Any] = {}
        self._kernels: dict[int, Kernel] = {}
        self._prepared: dict[str, Any] = {}
        self._last_rows, self._last_fn = -1, None   # the row count of the last call and its fn

    def fn_for(self, num_tokens: int):
        bucket = token_bucket(num_tokens)
        fn = self._by_bucket.get(bucket)
        if fn is None:
            fn = self._bind(bucket)
        return fn

    def _bind(self, bucket: int, kernel: Kernel | None = None):
        self._last_rows = -1
        if bucket in self._kernels:   # a choice changes (a first binding changes nothing run)
            self.clock.tick()
        kernel = self._kernels[bucket] = kernel or self.selector.select(
            KernelQuery(self.op, self.dtype, bucket, self.dims))
        layout = kernel.weight_layout
        if layout is None and self._prepared:
            fn = self._plain_weight_guard(kernel)
        elif layout is None:
            fn = kernel.fn
        else:
            def fn(x, weight, *rest, _fn=kernel.fn, _layout=layout):
                prepared = self._prepared.get(_layout.name)
                if prepared is None:
                    prepared = self._prepared[_layout.name] = _layout.prepare(weight)
                return _fn(x, prepared, *rest)
        self._by_bucket[bucket] = fn
        return fn

    def _plain_weight_guard(self, kernel: Kernel):
        def fn(x, weight, *rest):
            if weight is None:  # adopt_weight_layouts dropped it: this bucket was not chosen
                raise KernelError(f"{self.op}: kernel {kernel.name} needs the plain weight, "
                                  "which was converted for the buckets profiled at start-up")
            return kernel.fn(x, weight, *rest)
        return fn

    def __call__(self, *args: Any) -> Any:
        rows = args[0].shape[0]
        if rows != self._last_rows:   # every layer's site meets the step's row count once
            self._last_fn, self._last_rows = self.fn_for(rows), rows
        return self._last_fn(*args)

    def kernels_for(self, *args: Any) -> tuple[Kernel, ...]:
        """The kernel a call with `args` runs (bound now if its bucket is new): what a device
        recording the plan (PlanTracer) checks before it records the call."""
        bucket = token_bucket(args[0].shape[0])
        if bucket not in self._kernels:
            self._bind(bucket)
        return (self._kernels[bucket],)

    def choose(self, num_tokens: int) -> tuple[str, str]:
        """Select (profiling if needed) the kernel of a bucket now: (bucket key, kernel)."""
        bucket = token_bucket(num_tokens)
        if bucket not in self._kernels:
            self._bind(bucket)
        return (KernelQuery(self.op, self.dtype, bucket, self.dims).bucket_key,
                self._kernels[bucket].name)

    def unify_layout(self) -> None:
        """Make every chosen bucket read one weight form, so the site never holds two. Of the
        forms the buckets chose (plain weights among them when some bucket chose a plain
        kernel), the one whose kernels lose least against each bucket's own choice (time
        ratios summed over the buckets; ties: plain first, then by name) takes every bucket,
        each on its fastest correct kernel of that form; if no layout serves every bucket,
        every bucket goes back to plain kernels. (A form is never won by a few slow buckets'
        neighbours: a prefill bucket's prepacked layout does not move the decode buckets off
        a native kernel 50x faster there.)"""
        layouts = {k.weight_layout for k in self._kernels.values()}
        if len(layouts) < 2:
            return
        options = sorted(layouts, key=lambda lay: "" if lay is None else "~" + lay.name)
        cost, layout = min(((self._layout_cost(lay), i), lay) for i, lay in enumerate(options))
        if cost[0] == float("inf"):
            self.use_plain()
            return
        self._rebind(lambda k: k.weight_layout == layout)

    def _layout_cost(self, layout: WeightLayout | None) -> float:
        """Summed over the chosen buckets: how many times slower the form's best kernel is
        than the bucket's best of all (inf if some bucket has none; None: plain weights)."""
        return sum(self.selector.slowdown(KernelQuery(self.op, self.dtype, b, self.dims),
                                          lambda k: k.weight_layout == layout)
                   for b in self._kernels)

    def use_plain(self) -> None:
        """Every bucket on its fastest plain-weight kernel (a shared weight stays plain)."""
        if any(k.weight_layout is not None for k in self._kernels.values()):
            self._prepared.clear()
            if not self._rebind(lambda k: k.weight_layout is None):
                raise KernelError(f"{self.op}: no plain-weight kernel serves every bucket")

    def _rebind(self, accept, dry_run: bool = False) -> bool:
        """Rebind the buckets whose kernel `accept` refuses to the best it takes; False
        (changing nothing) if some bucket has no such kernel."""
        alt = {b: self.selector.best(KernelQuery(self.op, self.dtype, b, self.dims), accept)
               for b, k in self._kernels.items() if not accept(k)}
        if any(k is None for k in alt.values()):
            return False
        if not dry_run:
            for b, k in alt.items():
                self._bind(b, k)
        return True

    def holds_prepared(self) -> bool:
        """True once the site has made its weight's layout form (adopt_weight_layouts)."""
        return bool(self._prepared)

    def sole_layout(self) -> WeightLayout | None:
        """The weight layout every bucket chosen so far reads, or None if any reads plain."""
        layouts = {k.weight_layout for k in self._kernels.values()}
        return layouts.pop() if len(layouts) == 1 and None not in layouts else None

    def prepare(self, weight: Any) -> Any:
        layout = self.sole_layout()
        if layout is None:
            raise KernelError(f"{self.op} site has no single weight layout to prepare")
        if layout.name not in self._prepared:
            self._prepared[layout.name] = layout.prepare(weight)
        return self._prepared[layout.name]


class AttentionSite:
    """write_kv_cache for all tokens, then decode and prefill kernels on their rows."""

    __slots__ = ("write", "decode", "prefill", "_meta", "_parts")

    def __init__(self, dtype: torch.dtype, dims: tuple, selector: KernelSelector,
                 clock: BindingClock | None = None) -> None:
        kv_dims = tuple((k, v) for k, v in dims
                        if k not in ("num_heads", "sliding_window", "logit_softcap"))
        self.write = KernelSite("write_kv_cache", dtype, kv_dims, selector, clock=clock)
        self.decode = KernelSite("attention_decode", dtype, dims, selector, clock=clock)
        self.prefill = KernelSite("attention_prefill", dtype, dims, selector, clock=clock)
        self._meta: AttentionMetadata | None = None
        self._parts: tuple[AttentionMetadata, AttentionMetadata] | None = None

    def kernels_for(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                    *features: Any) -> tuple[Kernel, ...] | None:
        """The kernels a call runs (KernelSite.kernels_for); None for a step with both decodes
        and prefills, which also concatenates their outputs."""
        if meta.num_prefills and meta.num_decodes:
            return None
        attend = self.decode if meta.num_prefills == 0 else self.prefill
        return self.write.kernels_for(k) + attend.kernels_for(q)

    def __call__(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                 *features: Any):
        """`features`: (sliding_window, logit_softcap) where the node has them (its dims say
        so, and only kernels that support them were chosen), passed on to the kernels."""
        self.write(k, v, kv_cache, meta.slot_mapping)
        if meta.num_prefills == 0:
            return self.decode(q, kv_cache, meta, scale, *features)
        if meta.num_decodes == 0:
            return self.prefill(q, kv_cache, meta, scale, *features)
        if meta is not self._meta:  # split once per step, reused by every layer
            self._meta, self._parts = meta, (meta.decode_part(), meta.prefill_part())
        dec, pre = self._parts
        nd = meta.num_decode_tokens
        return torch.cat((self.decode(q[:nd], kv_cache, dec, scale, *features),
                          self.prefill(q[nd:], kv_cache, pre, scale, *features)))


def adopt_weight_layouts(plan: ExecutionPlan, weights: dict[str, Any]) -> int:
    """Once every bucket a site can meet has its kernel (select_all_kernels over all of
    them), hand each weight whose only reader is a site whose kernels all read one layout to
    that layout: the site prepares it and the plan (and `weights`, by identity) drop the
    plain tensor in favour of the prepared one. Returns how many weights changed form."""
    readers: dict[int, int] = {}   # by tensor identity: one weight may fill several slots
    for ins in plan.instructions:
        for a in ins.args:
            if isinstance(a, Slot) and a.index in plan.constants:
                key = id(plan.constants[a.index])
                readers[key] = readers.get(key, 0) + 1
    adopted = 0
    for ins in plan.instructions:
        site = ins.fn
        if not isinstance(site, KernelSite) or len(ins.args) < 2:
            continue
        w = ins.args[1]
        if isinstance(w, Slot) and w.index not in plan.constants and site.holds_prepared():
            continue  # adopted by an earlier call: it reads its prepared weight already
        if not isinstance(w, Slot) or w.index not in plan.constants \
                or readers.get(id(plan.constants[w.index])) != 1:
            site.use_plain()  # shared (e.g. a tied embedding): one plain copy serves all
            continue
        site.unify_layout()
        if site.sole_layout() is None:
            continue
        plain = plan.constants.pop(w.index)
        prepared = site.prepare(plain)
        for name, value in weights.items():
            if value is plain:
                weights[name] = prepared
        adopted += 1
    return adopted


def select_all_kernels(plan: ExecutionPlan, num_tokens: int, max_seqs: int) -> dict[str, str]:
    """Choose every site's kernel for a step of `num_tokens` tokens (decode attention for at
    most `max_seqs` sequences); returns {bucket key: kernel name}."""
    choices: dict[str, str] = {}
    for ins in plan.instructions:
        site = ins.fn
        if isinstance(site, KernelSite):
            sites = [(site, min(num_tokens, max_seqs) if site.per_sequence else num_tokens)]
        elif isinstance(site, AttentionSite):
            sites = [(site.write, num_tokens), (site.prefill, num_tokens),
                     (site.decode, min(num_tokens, max_seqs))]
        else:
            continue
        for s, n in sites:
            key, name = s.choose(n)
            choices[key] = name
    return choices


class CollectiveSite:
    """A collective of the tensor-parallel group (all_reduce, or all_gather over the last
    dim), through the engine's Communicator."""

    __slots__ = ("_call",)

    def __init__(self, target, comm: Communicator) -> None:
        if target is ops.all_reduce:
            self._call = comm.all_reduce
        else:
            self._call = lambda x: comm.all_gather(x, -1)

    def kernels_for(self, x: torch.Tensor) -> None:
        """None: a collective is more than kernels (it talks to the other ranks)."""
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(x)


def _bind(node: fx.Node, dtype: torch.dtype, selector: KernelSelector,
          comm: Communicator | None, clock: BindingClock):
    if node.target in ops.COLLECTIVE_OPS:
        if comm is None:
            raise KernelError(f"{node.format_node()}: a sharded graph needs the tensor-parallel "
                              "group's communicator")
        return CollectiveSite(node.target, comm)
    name = ops.op_name(node.target)
    if name == "attention":
        return AttentionSite(dtype, node.meta["dims"], selector, clock)
    if name is not None:
        return KernelSite(name, dtype, node.meta["dims"], selector,
                          per_sequence=node.meta.get("role") == "lm_head", clock=clock)
    if node.target is operator.getitem or node.target in ops.STRUCTURAL_OPS:
        return node.target
    raise KernelError(f"cannot lower node {node.format_node()}: unknown target")


def lower(mg: ModelGraph, selector: KernelSelector, dtype: torch.dtype,
          comm: Communicator | None = None) -> ExecutionPlan:
    """`comm`: the tensor-parallel group's collectives (required by a sharded graph)."""
    slot_of: dict[fx.Node, int] = {}
    inputs: dict[str, int] = {}
    constants: dict[int, Any] = {}
    pending: list[tuple[fx.Node, Any]] = []
    clock = BindingClock()
    output = -1
    for node in mg.graph.nodes:
        if node.op == "output":
            output = slot_of[node.args[0]]
            continue
        slot_of[node] = len(slot_of)
        if node.op == "placeholder":
            inputs[node.target] = slot_of[node]
        elif node.op == "get_attr":
            constants[slot_of[node]] = mg.weights[node.target]
        elif node.op == "call_function":
            pending.append((node, _bind(node, dtype, selector, comm, clock)))
        else:
            raise KernelError(f"cannot lower node kind {node.op!r}")
    last_use: dict[int, int] = {}
    for idx, (node, _) in enumerate(pending):
        last_use[slot_of[node]] = idx  # a result nobody reads is released at once
    for idx, (node, _) in enumerate(pending):
        for a in node.all_input_nodes:
            if a.op == "call_function":
                last_use[slot_of[a]] = idx
    release: dict[int, list[int]] = {}
    for slot, idx in last_use.items():
        if slot != output:
            release.setdefault(idx, []).append(slot)
    instructions = []
    for idx, (node, fn) in enumerate(pending):
        args = tuple(Slot(slot_of[a]) if isinstance(a, fx.Node) else a for a in node.args)
        if any(isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a)
               for a in node.args):
            raise KernelError(f"nested node arguments are not supported: {node.format_node()}")
        instructions.append(Instruction(fn, args, slot_of[node], tuple(release.get(idx, ())),
                                        node.format_node()))
    return ExecutionPlan(instructions, len(slot_of), inputs, constants, output, clock)
