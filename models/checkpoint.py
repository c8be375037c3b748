"""Checkpoints of a training run: orbax, with the run's config inside.

Each checkpoint holds the parameters, the optimiser state and the run config
(model config, dataset spec and options), so a checkpoint alone rebuilds the
model that wrote it. Orbax's `CheckpointManager` decides when to save
(`save_interval_steps`, preemption) and keeps the last two; the workdir also
gets config.json, a readable copy of the run config that guards resuming.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from models import config as config_lib
from models import data as data_lib
from models import transformer

_KEEP = 2


class IncompatibleRunError(ValueError):
  """The workdir holds a run of a different model or dataset."""


def manager(workdir: str,
            save_interval_steps: int = 1) -> ocp.CheckpointManager:
  """The orbax manager of <workdir>/checkpoints, keeping the last two.

  Args:
    workdir: the run directory.
    save_interval_steps: `save` writes a checkpoint at multiples of this (and
      when orbax reaches a preemption sync point); `force` saves any step.

  Returns:
    The manager; close it when done.
  """
  return ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, "checkpoints")),
      options=ocp.CheckpointManagerOptions(
          max_to_keep=_KEEP, save_interval_steps=save_interval_steps,
          create=True),
  )


def run_config(cfg: config_lib.TransformerConfig, dataset,
               options: dict[str, Any]) -> dict[str, Any]:
  """The JSON record of a run: model config, dataset spec and options."""
  record = {"model": cfg.to_dict(), "data": dataset.spec(),
            "options": options}
  # Through JSON once, so the record saved equals the record restored.
  return json.loads(json.dumps(record, default=str))


def save(mngr: ocp.CheckpointManager, step: int, state: dict[str, Any],
         config: dict[str, Any], *, force: bool = False) -> bool:
  """Saves params, optimiser state and run config at `step` (asynchronously).

  Args:
    mngr: a `manager`.
    step: the number of training steps taken.
    state: {"params", "opt_state"}.
    config: the `run_config` record.
    force: save even off the manager's interval (an existing checkpoint of
      `step` is kept as it is).

  Returns:
    Whether a checkpoint is being written.
  """
  if force and mngr.latest_step() == step:
    return False
  return mngr.save(
      step,
      args=ocp.args.Composite(
          params=ocp.args.StandardSave(state["params"]),
          opt_state=ocp.args.StandardSave(state["opt_state"]),
          config=ocp.args.JsonSave(config),
      ),
      force=force,
  )


def _abstract(tree):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def restore_state(mngr: ocp.CheckpointManager, step: int,
                  state: dict[str, Any]) -> dict[str, Any]:
  """Params and optimiser state of `step`, shaped like `state`."""
  restored = mngr.restore(
      step,
      args=ocp.args.Composite(
          params=ocp.args.StandardRestore(_abstract(state["params"])),
          opt_state=ocp.args.StandardRestore(_abstract(state["opt_state"])),
      ),
  )
  return {"params": restored["params"], "opt_state": restored["opt_state"]}


def restore_config(mngr: ocp.CheckpointManager, step: int) -> dict[str, Any]:
  """The run config saved with the checkpoint of `step`."""
  restored = mngr.restore(
      step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
  return restored["config"]


def _architecture(model: dict[str, Any]) -> dict[str, Any]:
  """The config fields that change the parameters' shapes or meaning."""
  ignore = ("attention_impl", "attention_block_sizes", "remat", "dtype")
  return {k: v for k, v in model.items() if k not in ignore}


def write_run_config(workdir: str, config: dict[str, Any],
                     resuming: bool) -> None:
  """Writes <workdir>/config.json.

  Raises:
    IncompatibleRunError: when resuming, the workdir's run has a different
      model architecture or dataset.
  """
  path = os.path.join(workdir, "config.json")
  if resuming and os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    if (_architecture(old["model"]) != _architecture(config["model"])
        or old["data"] != config["data"]):
      raise IncompatibleRunError(
          f"{workdir} holds a run of a different model or dataset; pass "
          "--fresh to overwrite it or choose another --workdir.")
  with open(path, "w") as f:
    json.dump(config, f, indent=2)


def load_model(workdir: str, *, attention_impl: str | None = None):
  """The model of the latest checkpoint in `workdir`, for inference.

  Args:
    workdir: the run directory.
    attention_impl: the attention to run it with; None = its config's.

  Returns:
    (model, dataset, step, run config); the model runs on one device with
    the attention its config names.

  Raises:
    FileNotFoundError: no checkpoint in `workdir`.
  """
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise FileNotFoundError(f"no training run in {workdir!r}.")
  mngr = manager(workdir)
  try:
    step = mngr.latest_step()
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {workdir!r}.")
    config = restore_config(mngr, step)
    cfg = config_lib.TransformerConfig.from_dict(config["model"])
    if attention_impl is not None:
      cfg = dataclasses.replace(cfg, attention_impl=attention_impl)
    abstract = nnx.eval_shape(
        lambda: transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract)
    # Onto one device, whatever mesh the run trained on.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        params)
    restored = mngr.restore(
        step,
        args=ocp.args.Composite(params=ocp.args.StandardRestore(params)))
  finally:
    mngr.close()
  model = nnx.merge(graphdef, restored["params"])
  return model, data_lib.from_spec(config["data"]), step, config
