"""README.md's Python examples run as written.

Every ```python block of README.md (indented ones in list items included)
is executed: in a fresh namespace, or, where it continues an earlier block
(the README reads as one session: the flex attention example attends over
the quick start's q, k and v), in a copy of the namespace that block
leaves. A block that calls functions on names the text only describes
(`q_new`, `pages_k`, `layer`, ...) gets a small setup that defines them;
the block itself always runs unchanged. A block that cannot run on this
machine is listed in SKIP with its reason and reported as skipped.

A failure's traceback shows the block's code and its line in the block.
"""

import dataclasses
import functools
import linecache
import pathlib
import re
import textwrap

import jax
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

_FENCE = re.compile(r"^( *)(`{3,}|~{3,})(.*)$")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_PYTHON = ("python", "python3", "py")


@dataclasses.dataclass(frozen=True)
class Block:
  """One ```python block of a Markdown text.

  Attributes:
    line: the line (from 1) of its first line of code.
    heading: the nearest heading before it ("" if none).
    code: its code, dedented.
  """

  line: int
  heading: str
  code: str


def python_blocks(text: str) -> list[Block]:
  """The ```python blocks of a Markdown text, in order.

  Args:
    text: Markdown.

  Returns:
    The blocks; a fence's info string must be python, python3 or py.
  """
  blocks = []
  heading = ""
  fence = None  # (indent, marker, is python, first line index) while open
  lines = text.splitlines()
  for i, line in enumerate(lines):
    match = _FENCE.match(line)
    if fence is None:
      if match:
        indent, marker, info = match.groups()
        language = info.strip().split(" ")[0].lower()
        fence = (indent, marker, language in _PYTHON, i + 1)
      elif _HEADING.match(line):
        heading = _HEADING.match(line).group(1)
      continue
    indent, marker, is_python, first = fence
    closes = (match is not None and match.group(2).startswith(marker)
              and not match.group(3).strip())
    if not closes:
      continue
    if is_python:
      code = textwrap.dedent("\n".join(lines[first:i]) + "\n")
      blocks.append(Block(line=first + 1, heading=heading, code=code))
    fence = None
  if fence is not None:
    raise ValueError(f"README.md: the fence of line {fence[3]} never closes.")
  return blocks


def block_ids(blocks: list[Block]) -> list[str]:
  """Readable test ids: the heading, made an identifier, numbered after
  its first block."""
  ids, counts = [], {}
  for block in blocks:
    base = re.sub(r"\W+", "_", block.heading.lower()).strip("_") or "top"
    counts[base] = counts.get(base, 0) + 1
    ids.append(base if counts[base] == 1 else f"{base}_{counts[base]}")
  return ids


@dataclasses.dataclass(frozen=True)
class Context:
  """What a block needs before it runs as written.

  Attributes:
    after: the key of the earlier block whose names it uses (it runs in a
      copy of that block's namespace), or None for a fresh namespace.
    setup: code run first in that namespace, defining the names the text
      only describes (small shapes, so that the block runs in a second or
      two).
  """

  after: str | None = None
  setup: str = ""


# Keys: a line of the block, unique among the blocks.
QUICK_START = "out = pallas_fa.flash_attention(q, k, v, is_causal=True)"
FLEX = "def alibi(score, batch, head, q_idx, kv_idx, slopes):"

CONTEXTS = {
    # Decoding against a KV cache: a paged cache.
    "block_table=table)": Context(setup="""
import jax
import jax.numpy as jnp
import pallas_fa

B, T_new, N, K, H, page_size, max_pages = 2, 1, 8, 2, 64, 16, 4
pages_k = jax.random.normal(
    jax.random.key(0), (B * max_pages, page_size, K, H))
pages_v = jax.random.normal(
    jax.random.key(1), (B * max_pages, page_size, K, H))
table = jnp.arange(B * max_pages, dtype=jnp.int32).reshape(B, max_pages)
lengths = jnp.array([40, 64])
q_new = jax.random.normal(jax.random.key(2), (B, T_new, N, H))
"""),
    # The paged cache of MultiHeadAttention.
    "layer.init_cache(batch, max_length, page_size=16)": Context(setup="""
import jax
import jax.numpy as jnp
from flax import nnx
import pallas_fa

batch, max_length, features = 2, 64, 32
layer = pallas_fa.MultiHeadAttention(4, features, num_kv_heads=2,
                                     is_causal=True, rngs=nnx.Rngs(0))
prompt = jax.random.normal(jax.random.key(0), (batch, 8, features))
prompt_lengths = jnp.array([5, 8])
next_token = jax.random.normal(jax.random.key(1), (batch, 1, features))
"""),
    # Quantized, latent and shared-prefix caches: one head dim (576, as
    # MLA's) serves the latent call and the others; out_a and out_b attend
    # over the two halves of one cache.
    "pallas_fa.kv_cache.quantize(keys, jnp.int8)": Context(setup="""
import jax
import jax.numpy as jnp
import pallas_fa

B, S, N, K, H = 2, 64, 4, 1, 576
keys = jax.random.normal(jax.random.key(0), (B, S, K, H))
values = jax.random.normal(jax.random.key(1), (B, S, K, H))
v8, v_scale = pallas_fa.kv_cache.quantize(values, jnp.int8)
q_new = jax.random.normal(jax.random.key(2), (B, 1, N, H))
lengths = jnp.array([40, 64])
latent, k, v = keys, keys, values
pk = jax.random.normal(jax.random.key(3), (16, K, H))
pv = jax.random.normal(jax.random.key(4), (16, K, H))
out_a, lse_a = pallas_fa.decode_attention(
    q_new, k[:, :32], v[:, :32], jnp.array([32, 32]), is_causal=False,
    return_residual=True)
out_b, lse_b = pallas_fa.decode_attention(
    q_new, k[:, 32:], v[:, 32:], jnp.array([32, 32]), is_causal=False,
    return_residual=True)
"""),
    # FP8 attention inputs: the quick start's q, k and v.
    'pallas_fa.quantize_fp8(q, "head")': Context(after=QUICK_START),
    # Flex attention: the quick start's shapes and q, k and v.
    FLEX: Context(after=QUICK_START),
    # Flex attention in a Flax layer: the flex example's doc_ids.
    "y = layer(x, mask_mod_args=(doc_ids,))": Context(after=FLEX, setup="""
from flax import nnx

D = 64
x = jax.random.normal(jax.random.key(4), (B, T, D))
"""),
}

# Blocks that cannot run here (a GPU or TPU, a download), with the reason.
SKIP: dict[str, str] = {}

BLOCKS = python_blocks(README.read_text())
IDS = block_ids(BLOCKS)


def _index_of(key: str) -> int:
  """The index of the one block that contains `key`."""
  found = [i for i, block in enumerate(BLOCKS) if key in block.code]
  if len(found) != 1:
    raise LookupError(
        f"{len(found)} README.md blocks contain {key!r}; a key must name "
        f"exactly one.")
  return found[0]


def _key_of(index: int, table: dict) -> str | None:
  """The key of `table` that names block `index`, if any."""
  keys = [key for key in table if key in BLOCKS[index].code]
  assert len(keys) <= 1, f"keys {keys} all name one block"
  return keys[0] if keys else None


def _source_name(line: int) -> str:
  """The file name tracebacks give the block whose code starts at `line`."""
  return f"<README.md block at line {line}>"


def _run(code: str, line: int, namespace: dict) -> None:
  """Executes `code`, README.md's block whose code starts at line `line`.

  Its tracebacks show the block's code (registered with linecache) and
  lines counted from the block's first.
  """
  name = _source_name(line)
  linecache.cache[name] = (len(code), None, code.splitlines(True), name)
  exec(compile(code, name, "exec"), namespace)


@functools.cache
def _namespace_after(index: int) -> dict:
  """The names block `index` leaves, run with its context (cached: the
  blocks after it start from a copy)."""
  block = BLOCKS[index]
  key = _key_of(index, CONTEXTS)
  context = CONTEXTS[key] if key else Context()
  namespace = {"__name__": "__main__"}
  if context.after is not None:
    earlier = _index_of(context.after)
    try:
      namespace = dict(_namespace_after(earlier))
    except Exception as error:
      pytest.fail(f"README.md:{BLOCKS[earlier].line}, the block this one "
                  f"continues, fails: {type(error).__name__}: {error}")
  if context.setup:
    name = f"<setup of {_source_name(block.line)[1:-1]}>"
    exec(compile(context.setup, name, "exec"), namespace)
  # As a user runs it: jax's default rank promotion, not the suite's.
  with jax.numpy_rank_promotion("allow"):
    _run(block.code, block.line, namespace)
  return namespace


def test_readme_has_python_blocks():
  """The README still has the examples this file is about."""
  assert len(BLOCKS) >= 5, BLOCKS


def test_every_key_names_one_block():
  """A key that no longer matches its block fails here, not silently."""
  for key in [*CONTEXTS, *SKIP]:
    _index_of(key)
  for key, context in CONTEXTS.items():
    if context.after is not None:
      assert _index_of(context.after) < _index_of(key), (
          f"{key!r} runs after a block that comes later")


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=IDS)
def test_block_runs(index):
  """README.md's `index`th Python block runs without an error."""
  reason = SKIP.get(_key_of(index, SKIP))
  if reason is not None:
    pytest.skip(f"README.md:{BLOCKS[index].line}: {reason}")
  _namespace_after(index)


def test_a_broken_block_fails():
  """The harness runs the code: a stale name in a block is an error, whose
  traceback names the block by its line in the README."""
  text = textwrap.dedent("""\
      # Title

      ```python
      import pallas_fa
      ```

      - item:

        ```python
        pallas_fa.no_such_function()
        ```
      """)
  blocks = python_blocks(text)
  assert [b.line for b in blocks] == [4, 10]
  assert block_ids(blocks) == ["title", "title_2"]
  namespace = {}
  _run(blocks[0].code, blocks[0].line, namespace)
  with pytest.raises(AttributeError, match="no_such_function") as error:
    _run(blocks[1].code, blocks[1].line, namespace)
  lines = [entry.lineno + 1 for entry in error.traceback
           if str(entry.path) == _source_name(10)]
  assert lines == [1]
