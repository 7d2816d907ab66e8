"""ModelProfile: what the planner knows about a model, per block, measured from its FX graph.

Data only: ``whalepy.profile(model, example_inputs)`` (:mod:`whalepy.frontend.profile`) captures the
model (no weights materialised; the meta device is fine), runs the analysis passes in ``whalepy.passes`` and summarises the graph into blocks:
the units of pipeline partitioning (transformer layers, the embeddings, the head). Figures are for the
example inputs' batch; the planner scales FLOPs and activation bytes linearly in the batch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from whalepy.ir.plan import TPRule


class BlockKind(str, enum.Enum):
    EMBEDDING = "embedding"
    LAYER = "layer"  # one of a run of structurally identical blocks (transformer layers)
    HEAD = "head"
    OTHER = "other"


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockAnnotations:
    """The effective user annotations of a block (inherited from enclosing scopes)."""

    split: int | None = None
    """Tensor-parallel degree fixed by ``split(n)``; ``0`` means ``split()`` without a degree."""
    replicate: int | None = None
    """Data-parallel degree fixed by ``replicate(n)``; ``0`` means ``replicate()`` without a degree."""
    stage: int | None = None
    """Index of the ``stage()`` scope the block is in, numbered 0.. in model order."""
    cluster_gpu: str | None = None
    """GPU type the block is pinned to by ``cluster(gpu=...)``."""
    cluster_group: str | None = None
    """Cluster node-group name the block is pinned to by ``cluster(group=...)``."""
    cluster_count: int | None = None
    """Number of devices the pinned region uses, from ``cluster(count=...)``."""
    cluster_nodes: int | None = None
    """Number of nodes the pinned region uses, from ``cluster(nodes=...)``."""
    sources: tuple[str, ...] = ()
    """Human-readable origins, e.g. ``"split(4) on transformer.h.0.mlp"``, for error messages."""

    @property
    def is_empty(self) -> bool:
        return (
            self.split is None
            and self.replicate is None
            and self.stage is None
            and self.cluster_gpu is None
            and self.cluster_group is None
            and self.cluster_count is None
            and self.cluster_nodes is None
        )


@dataclass(frozen=True, slots=True)
class GemmShape:
    """One matrix product of a block's forward, ``[batch x] (m x k) @ (k x n)``, at the profile's batch.

    Its backward runs ``dX = dY W^T`` as ``(m x n) @ (n x k)`` when ``grad_input`` and ``dW = X^T dY``
    as ``(k x m) @ (m x n)`` when ``grad_weight``. ``shard`` says which dimension a tensor-parallel
    rule of the weight's module divides: ``"n"`` (column-parallel), ``"k"`` (row-parallel), ``"batch"``
    (a product of two activations over the heads, inside the TP region) or ``""``."""

    m: int
    k: int
    n: int
    batch: int = 1
    grad_input: bool = True
    grad_weight: bool = True
    shard: str = ""


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """One fused attention call (``scaled_dot_product_attention``) at the profile's batch."""

    batch_heads: int
    """Batch times heads (heads split by tensor parallelism)."""
    q_len: int
    kv_len: int
    head_dim: int
    v_dim: int
    causal: bool
    needs_grad: bool = True


@dataclass(slots=True)
class MemoryBound:
    """A block's memory-bound traffic at the profile's batch, in the capture dtype and under ``torch.autocast``
    (recorded by ``whalepy.passes.autocast``, whose docstring says how; data only, so that a stored profile
    loads without torch)."""

    fwd: float = 0.0
    """Forward bytes in the capture dtype."""
    bwd: float = 0.0
    """Backward bytes in the capture dtype."""
    amp_fwd: float = 0.0
    """Forward bytes under autocast (16-bit and fp32 tensors as autocast runs them), casts excluded."""
    amp_bwd: float = 0.0
    cast_act: float = 0.0
    """Elements of activations autocast casts down (fp32 -> 16-bit) in the forward, per consuming op."""
    cast_act_grad: float = 0.0
    """Of those, elements whose gradient is cast back up (16-bit -> fp32) in the backward."""
    cast_param: float = 0.0
    """Elements of parameters autocast casts down, once per forward."""
    cast_param_grad: float = 0.0
    """Of those, elements whose gradient is cast up (trainable)."""
    upcast_act: float = 0.0
    """Elements of 16-bit activations an fp32 op upcasts in the forward (its gradient is cast down)."""
    mixed_grad_casts: float = 0.0
    """Elements of 16-bit inputs of mixed-dtype element-wise ops (fp32 residual + 16-bit branch): their
    gradient is cast down in the backward."""
    cast_launches_fwd: int = 0
    cast_launches_bwd: int = 0
    amp_saved: float = 0.0
    """Activation bytes the block's backward keeps under autocast (``whalepy.passes.memory``'s rules,
    each tensor in autocast's dtype; a 16-bit op's fp32 activation input is kept as the op's own cast
    copy, one per consuming op)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockKernels:
    """What a block's forward runs on the device, for the shape-dependent compute model
    (:mod:`whalepy.cost_models.compute`); recorded by ``whalepy.passes.kernels``."""

    gemms: tuple[GemmShape, ...] = ()
    attention: tuple[AttentionShape, ...] = ()
    memory_bytes: float = 0.0
    """Bytes read and written by the forward's other kernels (norms, activations, element-wise, copies)."""
    ops_fwd: int = 0
    """Kernel launches of the forward (nodes that touch memory)."""
    ops_bwd: int = 0
    """Kernel launches of the backward: one per input of a forward node that needs a gradient (an
    estimate; see ``whalepy.passes.kernels``)."""
    memory_bytes_bwd: float | None = None
    """Bytes of the backward's memory-bound kernels (``whalepy.passes.autocast``); None:
    :data:`~whalepy.cost_models.compute.MEMORY_BOUND_BACKWARD_RATIO` times the forward's."""
    amp: Any = None
    """The same under ``torch.autocast`` over fp32 parameters, and autocast's casts: a
    :class:`MemoryBound` (None: not recorded; the 16-bit figures are used)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TiedCopy:
    """A parameter a block holds that the profile counts in another block (its owner)."""

    owner: str
    """Name of the block whose ``num_params`` count the parameter."""
    parameter: str
    """The parameter's name in the model (its first name, as ``named_parameters`` gives it)."""
    num_params: int
    tp_split: bool = False
    """Tensor parallelism shards the copy (a rule of the holding block names its module with a style
    that shards it, :func:`whalepy.ir.rules.tp_shards_parameter`)."""
    rows: tuple[int, ...] = ()
    """The parameter's ``(rows, elements, tp)`` as in :attr:`BlockProfile.param_rows`, where the holding
    block's rule shards it (FSDP2 splits the copy's first dimension too); empty: unknown (profiles made
    before this field), charged as ``num_params / dp``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockProfile:
    """Cost-relevant figures of one partitioning unit, at the profile's batch size."""

    name: str
    """Module path of the block (``"transformer.h.3"``) or a synthetic name (``"embed"``, ``"head"``)."""
    index: int
    """Position in execution order, 0-based."""
    kind: BlockKind
    modules: tuple[str, ...]
    """Top-level module paths the block covers (parameters of these belong to the block)."""
    repeat_group: int | None = None
    """Blocks with equal structure (same ops, shapes, parameter shapes) share an id; the planner ties them."""
    num_params: int
    param_bytes: int
    fwd_flops: float
    bwd_flops: float
    bytes_moved: float
    """Memory traffic of forward (inputs + outputs + weights of every op), bytes."""
    activation_bytes: int
    """Bytes saved for backward by the block's forward (no checkpointing)."""
    input_bytes: int
    """Bytes of the tensors flowing into the block (what a checkpointed block keeps, and the p2p size
    when a stage boundary falls before it)."""
    output_bytes: int
    tp_rules: tuple[TPRule, ...] = ()
    """How tensor parallelism would split this block's modules (empty: no TP pattern found)."""
    tp_whole: tuple[tuple[str, str], ...] = ()
    """``(module path, why)``: the block's modules with parameters that tensor parallelism leaves whole
    on every rank (no pattern, fused layout unsupported, ...); see :meth:`ModelProfile.tp_report`."""
    tp_whole_params: int = 0
    """Of :attr:`num_params`, the parameters that stay whole on every rank when the block runs
    tensor-parallel (:func:`whalepy.ir.rules.tp_shards_parameter`: norms, ``replicate`` rules, the
    biases of row-parallel linears and of fused projections, position embeddings, modules without a
    rule); the rest are split by the TP degree (:func:`whalepy.ir.rules.tp_local_params`). 0 (profiles
    made before this field): all of them split."""
    param_rows: tuple[tuple[int, int, int], ...] = ()
    """Per parameter the block owns (those :attr:`num_params` counts, sorted), ``(rows, elements, tp)``:
    its first dimension, its elements and how tensor parallelism splits it where the block runs split
    (:func:`whalepy.ir.rules.tp_splits`): ``0`` whole on every TP rank, ``1`` along its first dimension
    (column-parallel linear weights and biases, a vocabulary-parallel embedding), ``2`` along another
    (row-parallel linear weights). FSDP2 splits each parameter's (TP-local) first dimension with
    ``torch.chunk``: replica ``r`` of ``dp`` holds rows ``[r c, (r + 1) c)``, ``c = ceil(rows / dp)``, so
    the first replica holds more than ``1 / dp`` of a parameter whose rows ``dp`` does not divide
    (:func:`whalepy.ir.rules.fsdp_row_excess`). Empty: unknown (profiles made before this field,
    synthetic ones), charged as ``num_params / dp``."""
    tied_copies: tuple[TiedCopy, ...] = ()
    """Parameters the block's modules hold that the profile counts in another block (a tied weight:
    HF GPT-2's ``lm_head`` holds ``wte.weight``, counted in the embedding's block). A pipeline stage
    holding this block but not that one keeps a copy of each (``whalepy.runtime.tied``)."""
    tp_comm_bytes: int = 0
    """Bytes all-reduced per forward when the block runs tensor-parallel (outputs of rowwise modules and
    vocab-parallel embeddings)."""
    tp_comm_backward_bytes: int | None = None
    """Bytes all-reduced per backward when the block runs tensor-parallel: the input gradients of the
    column-parallel modules, once per input sibling linears share (separate q, k and v projections:
    one); None where not recorded (synthetic profiles: the forward's bytes are charged again)."""
    tp_gather_bytes: int = 0
    """Bytes all-gathered per forward when the block runs tensor-parallel: the output of a
    column-parallel module no row-parallel one reads (an LM head's logits)."""
    tp_degrees: tuple[int, ...] = (1,)
    """TP degrees every sharded dimension of the block (heads, features, vocab) divides by."""
    linear_params: int = 0
    """Parameters of the block's tileable modules (:func:`whalepy.ir.tiling.tileable_modules`: its
    ``nn.Linear`` s and ``nn.Embedding`` s, weights and biases; 0: unknown or none). With
    :attr:`largest_linear_params` it sizes the FSDP2 units of a tiled block (``BlockPlan.tiles``); only
    the tiling uses these four fields (a block's time is costed from :attr:`kernels` and its FLOPs)."""
    largest_linear_params: int = 0
    """Parameters of the block's largest tileable module (0: unknown or none; then the planner does not
    tile the block)."""
    num_linears: int = 0
    """How many tileable modules (linears and embeddings) the tiling counts (each becomes ``tiles``
    FSDP2 units)."""
    linear_rows: tuple[tuple[int, int], ...] = ()
    """Per tileable module, ``(rows, parameters per row)``: a linear's output features and input
    features (+1 for a bias), an embedding's vocabulary and width; a tile of ``t`` has ``ceil(rows / t)``
    rows at most (:func:`whalepy.ir.tiling.largest_tile_params`); empty: unknown."""
    shared_param_numel: int = 0
    """Elements of the parameters :attr:`shares_params` counts (each once): a tied weight's size, whose
    gradient the pipeline stages holding copies of it sum every step."""
    shares_params: bool = False
    """A module of the block shares a parameter with a module outside it (a tied weight, e.g. GPT-2's
    ``lm_head.weight`` is ``wte.weight``; ``whalepy.pseudo_to_real``'s tied layers). FSDP2 keeps such a
    parameter in the stage's root unit, so all such blocks of one stage keep their states in one tier
    (:func:`whalepy.ir.rules.shared_unit_tiers_error`)."""
    annotations: BlockAnnotations = field(default_factory=BlockAnnotations)
    kernels: BlockKernels | None = None
    """GEMM and attention shapes, memory-bound bytes and launches of the forward; None when unknown
    (the compute model then costs ``fwd_flops`` / ``bytes_moved`` as a whole)."""


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """Whole-model summary; ``print(profile)`` shows a table of blocks."""

    model_name: str
    fingerprint: str
    """Stable hash of module paths and parameter shapes and dtypes."""
    batch_size: int
    seq_len: int | None
    """Tokens per sample when the first input is ``[batch, seq]`` token ids, else None."""
    total_params: int
    param_bytes: int
    blocks: tuple[BlockProfile, ...]
    dtype: str = "float32"
    """Floating dtype of most parameters, in which the byte figures were measured (``"bfloat16"``...).
    The planner rescales activation and communication bytes to its training precision."""
    capture_method: str = "export"
    """``"export"`` (torch.export, non-strict) or ``"symbolic_trace"`` (the fallback)."""
    capture_time_s: float = 0.0
    graph: Any = field(default=None, repr=False, compare=False)
    """The analysed ``torch.fx.GraphModule`` (node.meta carries the ``whalepy.*`` keys)."""
    measured: Any = field(default=None, repr=False, compare=False)
    """A :class:`whalepy.ir.measured.MeasuredCosts` of this model's blocks on the local device type
    (``whalepy.profile(..., measure=True)``), which the planner prefers to its model for that type."""

    @property
    def fwd_flops(self) -> float:
        return sum(b.fwd_flops for b in self.blocks)

    @property
    def bwd_flops(self) -> float:
        return sum(b.bwd_flops for b in self.blocks)

    @property
    def train_flops(self) -> float:
        """Forward + backward FLOPs of one training step at ``batch_size`` (no recomputation)."""
        return self.fwd_flops + self.bwd_flops

    def block(self, name: str) -> BlockProfile:
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(f"no block named {name!r}; blocks are {[b.name for b in self.blocks]}")

    def tp_report(self) -> str:
        """Per block, which modules tensor parallelism splits and how, and which stay whole and why."""
        from whalepy.ir.profile_text import format_tp_report

        return format_tp_report(self.blocks)

    def __str__(self) -> str:
        from whalepy.ir.profile_text import format_profile

        return format_profile(self)
