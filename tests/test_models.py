"""Tests of the transformer, its decoding, generation and built-in data."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_fa
from models import config
from models import data
from models import generate
from models import layers
from models import train_lib
from models import transformer
from pallas_fa import chunked
from pallas_fa import flex
from pallas_fa import modules

_TILES = chunked.ChunkedBlockSizes(
    block_q=8, block_kv=8, block_q_bwd=8, block_kv_bwd=8)
_RNG = np.random.default_rng()
_VOCAB = 37


def _cfg(**kw):
  kw = dict(vocab_size=_VOCAB, num_layers=2, embed_dim=32, num_heads=4,
            num_kv_heads=2, mlp_dim=48, max_len=64) | kw
  return config.TransformerConfig.tiny(**kw)


def _model(cfg, seed):
  return transformer.Transformer(cfg, rngs=nnx.Rngs(seed))


def _tokens(b, t):
  return jnp.asarray(_RNG.integers(0, _VOCAB, (b, t)), jnp.int32)


def _seed():
  return int(_RNG.integers(1 << 20))


@jax.jit
def _ce(logits, targets):
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


# Module-level so every test with the same model structure shares one
# compilation.
@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, tokens):
  return nnx.merge(graphdef, params)(tokens)


def test_config_validation_and_round_trip():
  cfg = _cfg(attention_impl="chunked", attention_block_sizes=_TILES)
  assert cfg.resolved_head_dim == 8
  again = config.TransformerConfig.from_dict(
      json.loads(json.dumps(cfg.to_dict())))
  assert again == cfg and hash(again) == hash(cfg)
  with pytest.raises(ValueError, match="num_kv_heads"):
    _cfg().replace(num_kv_heads=3)
  with pytest.raises(ValueError, match="embed_dim"):
    config.TransformerConfig(vocab_size=5, embed_dim=30, num_heads=4)
  with pytest.raises(ValueError, match="dtype"):
    _cfg(dtype="int8")
  with pytest.raises(ValueError, match="vocab_size"):
    config.TransformerConfig(vocab_size=0)
  with pytest.raises(ValueError, match="position_bias"):
    _cfg(position_bias="t5")
  with pytest.raises(ValueError, match="head_dim"):
    _cfg(head_dim=7)
  assert _cfg(head_dim=7, position_bias="alibi").resolved_head_dim == 7
  assert config.TransformerConfig.small().num_layers == 6
  assert _cfg(num_heads=np.int64(4)).num_heads == 4  # numpy ints count
  for kw, match in (
      (dict(attention_impl="bogus"), "attention_impl must be None or one of"),
      (dict(head_dim=0), "head_dim must be a positive int or None"),
      (dict(head_dim=6.0), "head_dim must be a positive int"),
      (dict(num_heads=4.0), "num_heads must be a positive int"),
      (dict(rope_base=0.0), "rope_base must be a finite number > 0"),
      (dict(norm_eps=-1.0), "norm_eps must be a finite number >= 0"),
      (dict(remat="yes"), "remat must be a bool"),
      (dict(use_sinks=1), "use_sinks must be a bool"),
      (dict(attention_impl="flax", use_sinks=True),
       "'flax' .a baseline. takes neither sinks nor a score_mod, got "
       "use_sinks=True"),
      (dict(attention_impl="cudnn", position_bias="alibi"),
       "position_bias='alibi'")):
    with pytest.raises(ValueError, match=match):
      _cfg(**kw)


def test_shapes_and_parameter_count():
  cfg = _cfg()
  model = nnx.eval_shape(lambda: _model(cfg, 0))
  graphdef, params = nnx.split(model)
  logits = jax.eval_shape(
      lambda p, x: nnx.merge(graphdef, p)(x), params,
      jax.ShapeDtypeStruct((3, 11), jnp.int32))
  assert logits.shape == (3, 11, _VOCAB) and logits.dtype == jnp.float32
  d, h, n, k, m = 32, 8, 4, 2, 48
  per_block = d * n * h + 2 * d * k * h + n * h * d + 3 * d * m + 2 * d
  assert transformer.count_params(model) == (
      _VOCAB * d + 2 * per_block + d)


def test_use_sinks_adds_a_sink_per_head_and_layer():
  cfg = _cfg(use_sinks=True)
  model = nnx.eval_shape(lambda: _model(cfg, 0))
  assert all(block.attn.sinks.shape == (cfg.num_heads,)
             for block in model.blocks)
  assert transformer.count_params(model) == transformer.count_params(
      nnx.eval_shape(lambda: _model(_cfg(), 0))) + 2 * cfg.num_heads
  with pytest.raises(NotImplementedError, match="Flax baseline"):
    layers.flax_attention(*(jnp.ones((1, 3, 4, 8)),) * 3,
                          sinks=jnp.zeros(4))


# Slow (two model gradients): CI runs it in its slow-test leg.
@pytest.mark.slow
def test_chunked_and_xla_give_same_loss_and_gradients():
  """Also against Flax's default attention, the benchmark baseline."""
  tokens = _tokens(2, 25)
  seed = _seed()
  results = {}
  for impl, tiles in (("xla", None), ("chunked", _TILES), ("flax", None)):
    # One layer: the check is of the attention path; compiling a second
    # copy of it would only cost time.
    cfg = _cfg(attention_impl=impl, attention_block_sizes=tiles, num_layers=1)
    graphdef, params = nnx.split(_model(cfg, seed))

    @jax.jit
    def loss_and_grad(params, tokens, graphdef=graphdef):
      loss = lambda p: _ce(
          nnx.merge(graphdef, p)(tokens[:, :-1]), tokens[:, 1:])
      return jax.value_and_grad(loss)(params)

    results[impl] = loss_and_grad(params, tokens)
  for impl in ("chunked", "flax"):
    np.testing.assert_allclose(
        results[impl][0], results["xla"][0], rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
        results[impl][1], results["xla"][1])
  assert float(results["xla"][0]) > 1.0  # A real loss, not a degenerate one.


def test_cudnn_baseline_refuses_what_jax_nn_cannot_take():
  """The cuDNN baseline (`--attention_impl=cudnn`) is jax.nn's attention:
  what that cannot express is a NotImplementedError naming it, and without
  a GPU the training script refuses it before building anything."""
  for kw in (dict(sinks=jnp.zeros(4)), dict(scale=0.5),
             dict(local_window_size=(8, 0)), dict(score_mod=flex.alibi)):
    with pytest.raises(NotImplementedError,
                       match="cuDNN baseline supports only"):
      layers.cudnn_attention(*(jnp.ones((1, 3, 4, 8)),) * 3, **kw)
  assert set(layers.BASELINES) == {"flax", "cudnn"}
  if jax.default_backend() != "gpu":
    from absl import app  # noqa: PLC0415
    opts = train_lib.Options(attention_impl="cudnn")
    with pytest.raises(app.UsageError, match="needs an NVIDIA GPU"):
      train_lib.make_config(opts, train_lib.make_dataset(opts))


def test_alibi_replaces_rope_with_constant_slopes():
  """position_bias="alibi": no RoPE, `flex.alibi` with the paper's slopes
  as constants (module state, not parameters)."""
  model = nnx.eval_shape(lambda: _model(_cfg(position_bias="alibi"), 0))
  for block in model.blocks:
    attn = block.attn
    assert attn.rope is None and attn.score_mod is flex.alibi
    assert isinstance(attn.score_mod_args[0], modules.Constant)
  assert transformer.count_params(model) == transformer.count_params(
      nnx.eval_shape(lambda: _model(_cfg(), 0)))
  with pytest.raises(NotImplementedError, match="Flax baseline"):
    layers.flax_attention(*(jnp.ones((1, 3, 4, 8)),) * 3,
                          score_mod=flex.alibi)


@pytest.mark.parametrize("position_bias", ["rope", "alibi"])
def test_decode_and_generate_match_full_forward(position_bias):
  b, t, prefill = 2, 21, 5
  cfg = _cfg(attention_impl="chunked", attention_block_sizes=_TILES,
             position_bias=position_bias)
  model = _model(cfg, _seed())
  prompt = _tokens(b, prefill)
  # Prefill, then one token per step through the cache (greedy).
  new, logits = generate.generate(
      model, prompt, t - prefill, return_logits=True)
  assert new.shape == (b, t - prefill)
  # The full forward over prompt + generated tokens gives the same logits.
  graphdef, params = nnx.split(model)
  full = _forward(graphdef, params, jnp.concatenate([prompt, new], axis=1))
  np.testing.assert_allclose(
      logits, full[:, prefill - 1:-1], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(new, jnp.argmax(logits, axis=-1))
  assert not jax.tree.leaves(nnx.state(model, nnx.Cache))  # model untouched.

  # Top-k sampling stays in the top k; the same key gives the same tokens.
  logits = jnp.asarray(_RNG.standard_normal((4, _VOCAB)), jnp.float32)
  keys = jax.random.split(jax.random.key(_seed()), 64)
  draws = jnp.stack([generate.sample_logits(logits, key, 1.0, 3)
                     for key in keys])
  top3 = jnp.argsort(logits, axis=-1)[:, -3:]
  assert bool(jnp.all(jnp.any(draws[..., None] == top3[None], axis=-1)))
  assert len(np.unique(np.asarray(draws))) > 3
  np.testing.assert_array_equal(
      generate.sample_logits(logits, keys[0], 0.7, None),
      generate.sample_logits(logits, keys[0], 0.7, None))
  with pytest.raises(ValueError, match="cache_length"):
    generate.generate(model, prompt[:, :3], 5, cache_length=6)


@pytest.mark.parametrize("impl", [None, "xla"])
def test_generate_mixed_prompt_lengths_matches_each_full_forward(impl):
  """Prompts of different lengths decode together; each row's logits equal
  the full forward of its own prompt + generated tokens. impl=None decodes
  through decode_attention, "xla" through flash_attention."""
  cfg = _cfg(attention_impl=impl)
  model = _model(cfg, _seed())
  lengths = np.array([3, 7, 1, 5])
  prompt = _tokens(4, 7)
  new, logits = generate.generate(
      model, prompt, 6, prompt_lengths=jnp.asarray(lengths),
      return_logits=True, temperature=0.0)
  graphdef, params = nnx.split(model)
  for row, n in enumerate(lengths):
    tokens = jnp.concatenate([prompt[row, :n], new[row]])[None]
    full = _forward(graphdef, params, tokens)[0]
    np.testing.assert_allclose(logits[row], full[n - 1:-1], rtol=1e-5,
                               atol=1e-5)
  np.testing.assert_array_equal(new, jnp.argmax(logits, axis=-1))
  with pytest.raises(ValueError, match="prompt_lengths"):
    generate.generate(model, prompt, 2, prompt_lengths=jnp.array([0, 1, 1, 1]))


def test_generate_with_paged_cache_matches_contiguous():
  """An 18-token prompt prefills through flash_attention on the gathered
  pages, the steps read the pages in decode_attention; pages of 5 divide
  neither the prompt nor the cache."""
  model = _model(_cfg(), _seed())
  lengths = jnp.asarray([18, 9, 13])
  prompt = _tokens(3, 18)
  run = functools.partial(generate.generate, model, prompt, 6,
                          prompt_lengths=lengths, return_logits=True)
  new, logits = run(page_size=5)
  want_new, want_logits = run()
  np.testing.assert_array_equal(new, want_new)
  np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="page_size"):
    run(page_size=0)


# --------------------------------------------------------------------------
# Built-in data.


@pytest.mark.parametrize("task", data.TASKS)
def test_synthetic_tasks(task):
  ds = data.SyntheticTask(task=task, length=5, num_symbols=7,
                          seed=int(_RNG.integers(1000)))
  batch = ds.batch(3, 16)
  assert all(v.shape == (16, ds.seq_len) for v in batch.values())
  np.testing.assert_array_equal(batch["inputs"][:, 1:],
                                batch["targets"][:, :-1])
  # The loss covers exactly the answer tokens.
  assert (batch["weights"].sum(axis=1) == ds.answer_len).all()
  prompts, answers = ds.examples(np.random.default_rng(1), 50)
  assert prompts.shape == (50, ds.prompt_len)
  assert answers.shape == (50, ds.answer_len)
  assert (prompts[:, 0] == data.BOS).all()
  body = prompts[:, 1:1 + (2 * ds.length if task == "recall" else ds.length)]
  if task == "copy":
    np.testing.assert_array_equal(answers, body)
  elif task == "sort":
    np.testing.assert_array_equal(answers, np.sort(body, axis=1))
  else:
    keys, values = body[:, 0::2], body[:, 1::2]
    query = prompts[:, -1:]
    assert all(len(set(row)) == ds.length for row in keys)
    np.testing.assert_array_equal(
        answers[:, 0], values[keys == query])
  # Batches are a pure function of (seed, split, step).
  np.testing.assert_array_equal(ds.batch(3, 16)["inputs"], batch["inputs"])
  assert not np.array_equal(ds.batch(4, 16)["inputs"], batch["inputs"])
  assert not np.array_equal(
      ds.batch(3, 16, "eval")["inputs"], batch["inputs"])
  assert data.from_spec(ds.spec()) == ds
  with pytest.raises(ValueError, match="task"):
    data.SyntheticTask(task="nope")


def test_train_flags_for_an_invalid_model_are_a_usage_error():
  """A baseline with sinks is refused by make_config, before train() writes
  anything."""
  from absl import app  # noqa: PLC0415
  opts = train_lib.Options(attention_impl="flax", use_sinks=True)
  with pytest.raises(app.UsageError, match="invalid model.*sinks"):
    train_lib.make_config(opts, train_lib.make_dataset(opts))


def test_cudnn_baseline_hands_decoding_to_flash_attention():
  """A decoding call (query positions) is one cuDNN's top-left causal mask
  cannot place; the baseline runs flash_attention for it, so a model
  trained with it samples. (On a CPU its training calls cannot run.)"""
  q = jnp.asarray(np.random.default_rng().standard_normal((2, 1, 4, 8)),
                  jnp.float32)
  kv = jnp.asarray(np.random.default_rng().standard_normal((2, 5, 2, 8)),
                   jnp.float32)
  kw = dict(is_causal=True, query_positions=jnp.array([[2], [4]]),
            key_value_seq_lengths=jnp.array([3, 5]))
  np.testing.assert_allclose(
      layers.cudnn_attention(q, kv, kv, **kw),
      pallas_fa.flash_attention(q, kv, kv, implementation="xla", **kw),
      rtol=1e-5, atol=1e-5)


def test_transformer_refuses_arguments_of_the_other_mode():
  model = _model(_cfg(), _seed())
  model.init_cache(1, 8)
  tokens = _tokens(1, 3)
  for kw in (dict(positions=jnp.arange(3)[None]),
             dict(segment_ids=jnp.ones((1, 3), jnp.int32))):
    with pytest.raises(ValueError, match="None when decoding"):
      model(tokens, decode=True, **kw)
  with pytest.raises(ValueError, match="decode_lengths needs decode=True"):
    model(tokens, decode_lengths=jnp.array([3]))


def test_generate_names_bad_sampling_arguments():
  model = _model(_cfg(), _seed())
  prompt = _tokens(2, 3)
  for kw, error, match in (
      (dict(top_k=0), ValueError, "top_k must be a positive int"),
      (dict(top_k=2.0), TypeError, "top_k must be an int"),
      (dict(temperature=-1.0), ValueError, "temperature must be finite"),
      (dict(temperature=float("nan")), ValueError, "temperature"),
      (dict(max_new_tokens=2.5), TypeError, "max_new_tokens must be an int"),
      (dict(max_new_tokens=0), ValueError,
       "max_new_tokens must be a positive int")):
    kw = dict(max_new_tokens=2) | kw
    with pytest.raises(error, match=match):
      generate.generate(model, prompt, **kw)


def test_text_data(tmp_path):
  path = tmp_path / "t.txt"
  text = "".join(chr(65 + i % 26) for i in range(3000)) + " héllo"
  path.write_text(text, encoding="utf-8")
  ds = data.TextData(source=str(path), seq_len=16)
  batch = ds.batch(0, 4)
  assert batch["inputs"].shape == (4, 16) and batch["weights"].all()
  np.testing.assert_array_equal(batch["inputs"][:, 1:],
                                batch["targets"][:, :-1])
  assert ds.decode(ds.encode("héllo")) == "héllo"
  assert ds.vocab_size == 256
  assert data.from_spec(ds.spec()).spec() == ds.spec()
  with pytest.raises(ValueError, match="seq_len"):
    data.TextData(source=str(path), seq_len=5000).batch(0, 1)
  # Every window of the train split is drawn, the last one included: 4
  # windows of 17 bytes in the 20 train bytes (the old bound drew 3).
  tiny = tmp_path / "tiny.txt"
  tiny.write_text("".join(chr(65 + i) for i in range(40)), encoding="utf-8")
  small = data.TextData(source=str(tiny), seq_len=16, eval_fraction=0.5)
  drawn = small.batch(0, 64)["targets"]
  np.testing.assert_array_equal(np.unique(drawn[:, -1]), small.corpus[16:20])
  for kw, error in ((dict(eval_fraction=1.5), ValueError),
                    (dict(eval_fraction=0.0), ValueError),
                    (dict(seq_len=8.5), TypeError),
                    (dict(seed=-1), ValueError)):
    with pytest.raises(error, match=next(iter(kw))):
      data.TextData(source=str(path), **kw)
  for kw, error in ((dict(num_symbols=3.0), TypeError),
                    (dict(length=0), ValueError)):
    with pytest.raises(error, match=next(iter(kw))):
      data.SyntheticTask(**kw)


def test_python_stdlib_corpus():
  files = data.python_stdlib_files()
  assert len(files) > 50 and any(f.endswith("os.py") for f in files)
  text = data.python_stdlib_text(max_bytes=100_000)
  assert len(text) == 100_000 and b"def " in text
