"""The benchmark's options (declared once), presets and resolved settings."""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Sequence

import jax.numpy as jnp

from pallas_fa import api
from pallas_fa import testing

MODES = ("fwd", "fwd_bwd")
# Float8 inputs: query/key/value quantized per head (`quantize_fp8`), the
# implementation given the float8 values and their float32 scales. Forward
# only: `flash_attention` has no gradient with respect to float8 arrays.
FP8_DTYPES = {"float8_e4m3fn": jnp.float8_e4m3fn}
FP8_MODES = ("fwd",)
DTYPES = {**testing.DTYPES, **FP8_DTYPES}
# A float8 cell's candidate label ends with this ("mosaic_gpu+e4m3"), so
# that the float8 and bfloat16 cells of one implementation are two columns
# of a merged table, not one.
FP8_LABEL_SUFFIX = "+e4m3"
# The ratio of a float8 cell to the same candidate's bfloat16 cell (its
# time / ours), beside those against `BASELINES`.
BF16_RATIO = "speedup_vs_bf16"
# Peers: `jax.nn.dot_product_attention` (xla, cudnn), JAX's Pallas Triton
# `mha`, its Hopper Mosaic GPU `attention_mgpu` and its TPU `flash_attention`,
# and tokamax's `dot_product_attention` (its Pallas Triton and Mosaic GPU
# kernels, and its blockwise XLA one, which also runs on a CPU) where tokamax
# is installed (it needs jax >= 0.11.1; BUILD.md says how to carry it).
PEERS = ("xla", "cudnn", "pallas_mha", "pallas_mgpu", "pallas_tpu",
         "tokamax_triton", "tokamax_mosaic", "tokamax_xla_chunked")
_TOKAMAX_PREFIX = "tokamax_"
# Peers of the float8 runs only, on float8 inputs: cuDNN's FP8 attention
# forward (`jax._src.cudnn.fused_attention_stablehlo`, where this JAX has
# it), given the same bfloat16 normals quantized per tensor (cuDNN takes one
# scale per tensor), checked against the reference of its own dequantized
# inputs.
FP8_PEERS = ("cudnn_fp8",)


def tokamax_implementation(peer: str) -> str | None:
  """tokamax's `implementation=` of a tokamax peer ("tokamax_triton" ->
  "triton"), or None for any other peer."""
  if peer not in PEERS or not peer.startswith(_TOKAMAX_PREFIX):
    return None
  return peer[len(_TOKAMAX_PREFIX):]


DEFAULT_PEERS = {
    "cpu": ("xla",),
    "gpu": ("xla", "cudnn", "pallas_mha", "pallas_mgpu", "tokamax_triton",
            "tokamax_mosaic"),
    "tpu": ("xla", "pallas_tpu"),
}
# The candidates that materialise the [B, N, T, S] logits: a bare number in
# --peer_max_seq limits these.
MATERIALISING = ("jax:xla", "xla")
# The peers ratios are taken against: record field -> peer label. Each
# record gets every field (None where that peer has no time for the cell).
# In order of preference: the Markdown table shows the first with a time.
# A float8 cell's are taken against the peer's bfloat16 cell (the peers
# take no float8 inputs): what FP8 attention replaces.
BASELINES = {"speedup_vs_cudnn": "jax:cudnn", "speedup_vs_xla": "jax:xla"}
# A float8 cell's ratios against the float8 peers' cells of the same shape
# and dtype (record field -> peer cell label): FP8 against FP8. Every record
# gets every field (None where there is no such cell, and on the peer's own).
FP8_BASELINES = {"speedup_vs_cudnn_fp8": "jax:cudnn_fp8+e4m3"}


def is_fp8(dtype: str) -> bool:
  """Whether the dtype name is a float8 one (`FP8_DTYPES`)."""
  return dtype in FP8_DTYPES


def cell_label(label: str, dtype: str) -> str:
  """The label of a candidate's cells of `dtype` (the record's "impl"):
  the candidate's own, `FP8_LABEL_SUFFIX` added for a float8 dtype."""
  return label + FP8_LABEL_SUFFIX if is_fp8(dtype) else label


def baseline_dtype(dtype: str) -> str:
  """The dtype of the cells a `dtype` cell's ratios are taken against:
  bfloat16 for a float8 one, else its own."""
  return "bfloat16" if is_fp8(dtype) else dtype

PRESETS = {
    # The foundation's CPU targets.
    "cpu": dict(
        seq_lens=(512, 1024, 2048, 4096),
        dtype="float32",
        batch=1,
        tokens=0,
        heads=8,
        model_dim=0,
        head_dim=(64,),
        causal="both",
        modes=MODES,
        repeats=5,
        warmup=1,
        peer_max_seq=("8192",),
        matmul_size=2048,
    ),
    # FlashAttention-2 paper protocol: B*T = 16k tokens, N*H = 2048.
    "fa": dict(
        seq_lens=(512, 1024, 2048, 4096, 8192, 16384),
        dtype="bfloat16",
        batch=0,
        tokens=16384,
        heads=0,
        model_dim=2048,
        head_dim=(64, 128, 256),
        causal="both",
        modes=MODES,
        repeats=10,
        warmup=2,
        peer_max_seq=(),
        matmul_size=8192,
    ),
}


@dataclasses.dataclass(frozen=True)
class Option:
  """One command-line option.

  Attributes:
    name: the flag's name, and the `make_settings` argument's if `setting`.
    kind: the absl flag type (`DEFINE_<kind>`): "enum", "list", "integer",
      "bool" or "string".
    help: the flag's help.
    default: its default; None for a preset value means "the preset's".
    choices: an enum's values.
    setting: an input of `make_settings` (else output or internal).
  """

  name: str
  kind: str
  help: str
  default: Any = None
  choices: tuple[str, ...] = ()
  setting: bool = True


OPTIONS = (
    Option("grid", "enum",
           "Preset: 'cpu' (foundation targets) or 'fa' (FlashAttention GPU "
           "protocol). Default: 'fa' on GPU, else 'cpu'.",
           choices=tuple(sorted(PRESETS))),
    Option("seq_lens", "list", "T = S values (preset default)."),
    Option("impls", "list",
           "pallas_fa implementations to time; default: those the automatic "
           "choice would try on this platform. NAME:FIELD=VALUE[:...] times "
           "NAME with its default tiling for each shape but those fields "
           "replaced (e.g. mosaic_gpu:backward=fused, "
           "mosaic_gpu:head_section=4), as a candidate of its own. An "
           "entry ending in +negated_query takes float8 inputs whose query "
           "values and scales are negated: the same attention, through the "
           "path a negative query scale takes."),
    Option("peers", "list",
           f"Peers among {PEERS}, or 'none'; default: those for this "
           f"platform. A float8 --dtype takes only {FP8_PEERS} (default "
           "none)."),
    Option("dtype", "enum",
           "Input dtype. float8_e4m3fn: bfloat16 normals quantized per head "
           "(pallas_fa.quantize_fp8), the implementations called with the "
           "float8 values and their scales and checked against the "
           "attention of the dequantized inputs; forward only (--modes "
           "defaults to fwd; fwd_bwd is an error), no bfloat16 peers (their "
           "bfloat16 cells, merged from another run, are the ratios' "
           "baselines) but the float8 ones (cudnn_fp8: cuDNN's FP8 "
           "forward on the same normals quantized per tensor), no matmul "
           "ceiling; its cells are labelled "
           f"'<impl>{FP8_LABEL_SUFFIX}'.",
           choices=tuple(sorted(DTYPES))),
    Option("batch", "integer", "B; 0 = tokens // T."),
    Option("tokens", "integer", "B * T when --batch=0."),
    Option("heads", "integer", "N; 0 = model_dim // H."),
    Option("model_dim", "integer", "N * H when --heads=0."),
    Option("head_dim", "list", "H values."),
    Option("causal", "enum", "Causal masking.",
           choices=("both", "true", "false")),
    Option("modes", "list",
           f"Subset of {MODES} (float8: {FP8_MODES} only)."),
    Option("sinks", "bool",
           "Also time every pallas_fa implementation with attention sinks, "
           "as '<impl>+sinks' (checked against the reference with the same "
           "sinks).", False),
    Option("repeats", "integer", "Timed runs per cell (median)."),
    Option("rounds", "integer",
           "Times each (shape, mode) group's candidates this many times, "
           "in turn (round 1: every candidate, round 2: every candidate, "
           "...), and keeps each candidate's fastest round (a round's time "
           "is the median of its runs). A slow spell of a shared machine "
           "then costs one round instead of all of one candidate's runs; "
           "the matmul ceiling is timed again in every round too.", 1),
    Option("warmup", "integer", "Untimed runs after compilation."),
    Option("json", "string",
           "Write the results as JSON here (rewritten after every cell).",
           setting=False),
    Option("plot", "string", "Write a PNG plot here.", setting=False),
    Option("markdown", "string",
           "Write a Markdown table here: a row per (mode, causal, H, T), a "
           "column per candidate, FLOP/s and the ratio against cuDNN (else "
           "xla); rewritten after every cell.", setting=False),
    Option("merge", "bool",
           "Keep the cells already in --json (earlier runs: another "
           "implementation's, say) and add this run's; the ratios, JSON and "
           "Markdown cover them all.", False, setting=False),
    Option("plot_metric", "enum", "Plot's y axis.", "flops",
           ("flops", "ms"), setting=False),
    Option("isolate", "bool",
           "Time each cell in a fresh process and report its peak memory. "
           "Default: on for CPU, off elsewhere."),
    Option("peer_max_seq", "list",
           "Longest T to run for memory-hungry candidates: 'LEN' applies to "
           f"the materialising ones {MATERIALISING}, 'LABEL=LEN' to one "
           "(e.g. jax:cudnn=8192); longer cells are reported as skipped "
           "(memory)."),
    Option("check_rows", "integer",
           "Above 2x this many queries (keys), the check compares only the "
           "first and last check_rows query rows of the output and dQ (key "
           "rows of dK and dV): the reference is quadratic in memory, and "
           "the comparison runs on the host.", 256),
    Option("reference_dir", "string",
           "Keep each shape's reference results here (a few MiB each) and "
           "read them back when another run (another implementation's "
           "process) checks the same shape: its compilation is then paid "
           "once per shape, not once per process."),
    Option("matmul_size", "integer",
           "M = N = K of the matmul-rate ceiling; 0 = skip."),
    Option("seed", "integer", "Seed of the random inputs.", 0),
    Option("cell_timeout", "integer", "Seconds an isolated cell may run.",
           1800),
    Option("child_spec", "string",
           "Internal: run one isolated cell (JSON) and exit.", setting=False),
)
SETTING_NAMES = tuple(o.name for o in OPTIONS if o.setting)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
  """One self-attention problem (T = S, N query and key/value heads)."""

  batch: int
  seq_len: int
  heads: int
  head_dim: int
  causal: bool
  dtype: str

  def __post_init__(self):
    for name in ("batch", "seq_len", "heads", "head_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"Shape.{name} must be a positive int, got {value!r}.")
    if self.dtype not in DTYPES:
      raise ValueError(f"Shape.dtype must be one of {sorted(DTYPES)}, got "
                       f"{self.dtype!r}.")

  def flops(self, mode: str) -> float:
    return testing.attention_flops(
        self.batch, self.heads, self.seq_len, self.seq_len, self.head_dim,
        causal=self.causal, mode=mode)

  def case(self) -> testing.Case:
    """The shape as a `testing.Case` (no mask beyond causal)."""
    return testing.Case(b=self.batch, t=self.seq_len, s=self.seq_len,
                        n=self.heads, k=self.heads, h=self.head_dim,
                        causal=self.causal)

  def __str__(self):
    return (f"B={self.batch} N={self.heads} H={self.head_dim} "
            f"T={self.seq_len} causal={self.causal} {self.dtype}")


# An --impls entry ending in this times the implementation on float8 inputs
# whose query values and scales are negated (the same attention): where a
# kernel takes another path for a negative scale (`mosaic_gpu`'s float8
# forward multiplies its row factor into the logits first), the A/B of
# that path against the default in one process.
NEGATED_QUERY = "+negated_query"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
  """Something to time: a pallas_fa implementation or a JAX peer.

  Attributes:
    kind: "impl" | "peer".
    name: the implementation or peer.
    sinks: an implementation called with `sinks=`.
    block_sizes: (field, value) pairs that replace those of the
      implementation's default tiling of each shape (`parse_impl`): two
      variants of one kernel (a backward path, a schedule) compared in the
      same process, each with every other tile the default call gets.
    negated_query: an implementation called on float8 inputs whose query
      values and scales are both negated (`NEGATED_QUERY`): the same
      attention, through the path a negative query scale takes.
  """

  kind: str
  name: str
  sinks: bool = False
  block_sizes: tuple[tuple[str, Any], ...] = ()
  negated_query: bool = False

  @property
  def label(self) -> str:
    if self.kind == "impl":
      fields = "".join(f":{k}={_show(v)}" for k, v in self.block_sizes)
      return (self.name + fields + ("+sinks" if self.sinks else "")
              + (NEGATED_QUERY if self.negated_query else ""))
    implementation = tokamax_implementation(self.name)
    if implementation is not None:
      return f"tokamax:{implementation}"
    return f"jax:{self.name}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  """Everything one benchmark run needs (options resolved against a preset)."""

  grid: str
  shapes: tuple[Shape, ...]
  candidates: tuple[Candidate, ...]
  modes: tuple[str, ...]
  repeats: int
  warmup: int
  rounds: int = 1
  isolate: bool
  max_seq: tuple[tuple[str, int], ...]  # (label, longest T)
  check_rows: int = 256
  reference_dir: str | None = None
  matmul_size: int = 0
  seed: int = 0
  cell_timeout: float = 1800.0
  min_repeat_s: float = 0.05


def default_impls(platform: str) -> tuple[str, ...]:
  """The implementations the automatic choice tries here, if they import.

  Args:
    platform: "cpu" | "gpu" | "tpu".

  Returns:
    Implementation names, fastest first; the others are printed as skipped.
  """
  order = api.AUTO_ORDER.get(platform, ("chunked",))
  names = []
  for name in order:
    try:
      api.get_backend(name)
    except NotImplementedError as e:
      print(f"impl {name}: skipped ({e})")
      continue
    names.append(name)
  return tuple(names)


def _parse_max_seq(entries: Sequence[str]) -> tuple[tuple[str, int], ...]:
  limits = {}
  for entry in entries:
    entry = entry.strip()
    if not entry:
      continue
    label, sep, value = entry.rpartition("=")
    try:
      length = int(value)
    except ValueError:
      raise ValueError(f"--peer_max_seq entries are LEN or LABEL=LEN, got "
                       f"{entry!r}.") from None
    for name in ((label,) if sep else MATERIALISING):
      limits[name] = length
  return tuple(sorted(limits.items()))


def _shapes(value) -> list[Shape]:
  seq_lens = [int(t) for t in value("seq_lens")]
  head_dims = [int(h) for h in value("head_dim")]
  batch, tokens = value("batch"), value("tokens")
  heads, model_dim = value("heads"), value("model_dim")
  causals = {"both": (False, True), "true": (True,), "false": (False,)}[
      value("causal")]
  shapes = []
  for h in head_dims:
    n = heads or model_dim // h
    for t in seq_lens:
      b = batch or tokens // t
      if b < 1 or n < 1:
        raise ValueError(
            f"Cannot form a shape from {batch=}, {tokens=}, {heads=}, "
            f"{model_dim=}, T={t}, H={h}.")
      for c in causals:
        shapes.append(Shape(batch=b, seq_len=t, heads=n, head_dim=h,
                            causal=c, dtype=value("dtype")))
  return shapes


def _show(value) -> str:
  return "None" if value is None else str(value).lower() if isinstance(
      value, bool) else str(value)


def _value(text: str):
  """A block-sizes field's value from its text: int, bool, None or str."""
  lowered = text.strip().lower()
  if lowered in ("none", "true", "false"):
    return {"none": None, "true": True, "false": False}[lowered]
  try:
    return int(text)
  except ValueError:
    return text.strip()


def parse_impl(spec: str) -> tuple[str, tuple[tuple[str, Any], ...]]:
  """(name, block-sizes fields) of an --impls entry NAME[:FIELD=VALUE...].

  Raises:
    ValueError: an unknown implementation, a malformed field, or a field
      its tiling config does not have (checked where the backend imports;
      a value is checked by the config itself when a cell builds it).
  """
  name, *fields = spec.strip().split(":")
  if name not in api.REGISTRY:
    raise ValueError(f"Unknown implementation {name!r}; expected one of "
                     f"{sorted(api.REGISTRY)}.")
  pairs = []
  for field in fields:
    key, sep, text = field.partition("=")
    if not sep or not key.strip():
      raise ValueError(f"--impls entries are NAME[:FIELD=VALUE...], got "
                       f"{spec!r}.")
    pairs.append((key.strip(), _value(text)))
  if pairs:
    try:
      kind = api.get_backend(name).block_sizes_type
    except NotImplementedError:
      kind = ()  # Reported per cell, as for the plain name.
    if kind is None:
      raise ValueError(f"{name} takes no tiling config: {spec!r}.")
    known = {f.name for f in dataclasses.fields(kind)} if kind else None
    unknown = [k for k, _ in pairs if known is not None and k not in known]
    if unknown:
      raise ValueError(f"{kind.__name__} has no field {unknown[0]!r} "
                       f"({spec!r}); it has {sorted(known)}.")
  return name, tuple(pairs)


def _candidates(impls, peers, sinks=False) -> list[Candidate]:
  negated = [spec.strip().endswith(NEGATED_QUERY) for spec in impls]
  parsed = [parse_impl(spec.strip().removesuffix(NEGATED_QUERY))
            for spec in impls]
  peers = [p for p in peers if p != "none"]
  for name in peers:
    if name not in PEERS + FP8_PEERS:
      raise ValueError(f"Unknown peer {name!r}; expected one of "
                       f"{PEERS + FP8_PEERS}.")
  return ([Candidate(kind="impl", name=n, block_sizes=b, negated_query=neg)
           for (n, b), neg in zip(parsed, negated)]
          + [Candidate(kind="impl", name=n, block_sizes=b, sinks=True)
             for n, b in (parsed if sinks else ())]
          + [Candidate(kind="peer", name=n) for n in peers])


def _positive(name: str, value) -> int:
  if int(value) < 1:
    raise ValueError(f"{name} must be at least 1, got {value!r}.")
  return int(value)


def make_settings(*, platform: str | None = None, **values) -> Settings:
  """Resolves option values (None = preset default) into `Settings`.

  Args:
    platform: "cpu" | "gpu" | "tpu"; default the JAX default backend.
    **values: any of `SETTING_NAMES`, as the flags of the same names
      (`OPTIONS`); grid defaults to "fa" on GPU, else "cpu".

  Returns:
    The resolved settings.

  Raises:
    TypeError: a name that is not a setting.
    ValueError: an unknown mode, peer or implementation, or a shape that
      cannot be formed.
  """
  unknown = sorted(set(values) - set(SETTING_NAMES))
  if unknown:
    raise TypeError(f"make_settings got unknown options {unknown}; expected "
                    f"some of {SETTING_NAMES}.")
  platform = platform or api.platform()
  grid = values.get("grid") or ("fa" if platform == "gpu" else "cpu")
  preset = PRESETS[grid]
  defaults = {o.name: o.default for o in OPTIONS}

  def value(name):
    given = values.get(name)
    if given is not None:
      return given
    return preset[name] if name in preset else defaults[name]

  dtype = value("dtype")
  fp8 = is_fp8(dtype)
  modes = tuple(FP8_MODES if fp8 and values.get("modes") is None
                else value("modes"))
  for mode in modes:
    if mode not in MODES:
      raise ValueError(f"modes must be a subset of {MODES}, got {modes=}.")
  if fp8 and set(modes) - set(FP8_MODES):
    raise ValueError(
        f"dtype={dtype!r} is forward only (flash_attention has no gradient "
        f"with respect to float8 inputs): pass --modes=fwd, got {modes=}.")
  impls = value("impls")
  impls = default_impls(platform) if impls is None else impls
  peers = value("peers")
  if peers is None:
    peers = () if fp8 else DEFAULT_PEERS.get(platform, ("xla",))
  named = [p for p in peers if p != "none"]
  if fp8 and set(named) - set(FP8_PEERS):
    raise ValueError(
        f"dtype={dtype!r} times pallas_fa's implementations and the float8 "
        f"peers {FP8_PEERS} only (the other peers take no float8 inputs; "
        f"their bfloat16 cells, merged with --merge, are the float8 cells' "
        f"baselines): pass --peers=none or some of {FP8_PEERS}, got "
        f"peers={tuple(peers)}.")
  if not fp8 and set(named) & set(FP8_PEERS):
    raise ValueError(
        f"the peers {FP8_PEERS} take float8 inputs: pass "
        f"--dtype={next(iter(FP8_DTYPES))}, got dtype={dtype!r} and "
        f"peers={tuple(peers)}.")
  isolate = value("isolate")
  return Settings(
      grid=grid,
      shapes=tuple(_shapes(value)),
      candidates=tuple(_candidates(impls, peers, bool(value("sinks")))),
      modes=modes,
      repeats=_positive("repeats", value("repeats")),
      warmup=int(value("warmup")),
      rounds=_positive("rounds", value("rounds")),
      isolate=(platform == "cpu") if isolate is None else bool(isolate),
      max_seq=_parse_max_seq(value("peer_max_seq")),
      check_rows=int(value("check_rows")),
      reference_dir=value("reference_dir") or None,
      matmul_size=int(value("matmul_size")),
      seed=int(value("seed")),
      cell_timeout=float(value("cell_timeout")),
  )
