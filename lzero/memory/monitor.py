"""``MemoryMonitor``: each rank's model-state memory by store and kind, beside what the ZeRO formula expects,
the step's peak memory and its communication, logged every ``log_every_n_steps`` to the Trainer's logger.

[Note: what the memory monitor logs]
After an optimizer step (gradients freed, see [Note: gradient buffers] in flat_unit.py) on every
``log_every_n_steps``-th step, each rank measures (no communication):

- ``memory/model_states_bytes/rank{r}``: parameters, gradients, fp32 masters and optimizer state this rank holds
  (``lzero.memory.accounting.model_state_bytes``), all stores, frozen parameters included (whole at stages 1-2: a
  frozen reference model, a LoRA or QLoRA base); ``memory/{store}/{kind}_bytes/rank{r}`` split by store
  (``device``, ``cpu``, ``nvme``) and kind; ``memory/{store}/buffers_bytes`` the offload staging buffers and the stage-3 blocks gathered at the time (kept by the gather schedule); ``memory/{store}/averages_bytes`` a weight-averaging
  callback's averaged shards (see [Note: averaged shards] in lzero/engine/averaged.py), counted in
  ``model_states_bytes`` too (the expectation below leaves them out).
- ``memory/model_states_expected_bytes/rank{r}``: what ``lzero.memory.estimate.model_states`` predicts for this
  configuration, model size and world size between steps (no gradients), for Adam-like, SGD, Adagrad and
  RMSprop optimizers (others: not logged), counting the frozen parameters as ``lzero estimate --frozen-params``
  does (cF at stages 1-2, cF/N at stage 3). Flat units are padded to a multiple of N: the measured value is
  a little higher on tiny models.
- ``memory/peak_device_bytes/rank{r}``: ``torch.cuda.max_memory_allocated`` since the last log (reset then);
  on CPU ``memory/peak_rss_bytes/rank{r}``: the process's VmHWM, reset through ``/proc/self/clear_refs``
  where the kernel allows it (else the peak since the start).
- ``comm/{reduce,all_gather,to_host,to_device,nvme_read,nvme_write}_bytes_per_step/rank{r}``: bytes handed to
  reduce-scatters, received from all-gathers, copied by the offload stores and moved by the swap files, per
  step since the last log.
- ``memory/schedule/{persistent_blocks,kept_blocks,gathers_per_step,predicted_peak_bytes,budget_bytes}/rank{r}``:
  what stage 3's ``schedule="auto"`` chose after the second step (see [Note: choosing the gather schedule] in
  engine/schedule.py), beside the measured peak.
- ``memory/monitor_seconds/rank{r}``: what this logging itself took.

All ranks' values travel to rank 0 in one all-gather of one tensor, and rank 0 logs them (TensorBoard shows one curve
per rank). Under pipeline parallel every stage's ranks are gathered (over the whole run) and each name says the stage:
``memory/model_states_bytes/stage{s}/rank{r}`` (``stage{s}+{s'}`` for a rank running several interleaved stages), r
the global rank; the expectation is the formula over that stage's own parameters. The fp16 loss scale is logged by the
precision plugin already (``lzero/loss_scale``).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from lzero.engine import collectives
from lzero.engine.rank_memory import peak_bytes, reset_peak
from lzero.memory.accounting import KINDS, model_state_bytes
from lzero.memory.optimizer_states import engine_state_bytes, padding_bytes

SCHEDULE = ("persistent_blocks", "kept_blocks", "gathers_per_step", "predicted_peak_bytes", "budget_bytes")
"""What stage 3's ``schedule="auto"`` chose ([Note: choosing the gather schedule] in engine/schedule.py), logged."""

TRAFFIC = ("reduce", "all_gather", "to_host", "to_device", "nvme_read", "nvme_write")


class MemoryMonitor(Callback):
    """See [Note: what the memory monitor logs]. ``every_n_steps``: None follows the Trainer's ``log_every_n_steps``
    (under Fabric: 50).

    Under Fabric it is a Fabric callback: ``Fabric(strategy="zero3", callbacks=[MemoryMonitor()], loggers=...)``
    logs through ``fabric.log_dict`` after every ``every_n_steps``-th optimizer step (the model set up with
    ``fabric.setup``, which hands the callback the Fabric)."""

    def __init__(self, every_n_steps: Optional[int] = None) -> None:
        self.every_n_steps = every_n_steps
        self._last_step = -1
        self._traffic_at: dict[str, int] = {}
        self._steps_at = 0
        self.cost_s: list[float] = []  # what each logged step's monitoring took on this rank
        self._fabric: Any = None
        self._fabric_steps = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._traffic_at, self._steps_at = _traffic(trainer.strategy.engine), trainer.global_step
        reset_peak(trainer.strategy.root_device)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        every = self.every_n_steps or trainer.log_every_n_steps
        if step == self._last_step or step % every or getattr(trainer.strategy, "engine", None) is None:
            return  # no optimizer step since the last call (accumulating), or not a logging step
        self._last_step = step
        log = trainer.logger.log_metrics if trainer.is_global_zero and trainer.logger is not None else None
        self.log_now(trainer.strategy.engine, trainer.strategy.optimizers, trainer.strategy.root_device, step, log)

    # --- Fabric's hooks --------------------------------------------------------------------------

    def on_after_setup(self, fabric: Any, module: Any) -> None:
        self._fabric = fabric

    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        engine_of = getattr(strategy, "engine_of", None)
        engine, optimizers = engine_of(optimizer) if engine_of is not None else (None, [])
        if engine is None or optimizer is not optimizers[0]:
            return  # not lzero's, or a later optimizer of the same step
        if self._fabric_steps == 0:
            self._traffic_at, self._steps_at = _traffic(engine), 0
        self._fabric_steps += 1
        if self._fabric_steps % (self.every_n_steps or 50):
            return
        fabric = self._fabric
        log = fabric.log_dict if fabric is not None and fabric.global_rank == 0 else None
        self.log_now(engine, optimizers, strategy.root_device, self._fabric_steps, log)

    # --- measuring ---------------------------------------------------------------------------

    def log_now(self, engine: Any, optimizers: list, device: torch.device, step: int, log: Any) -> None:
        """Measure on every rank (a collective: one all-gather) and hand rank 0's table to ``log(metrics, step)``."""
        start = time.perf_counter()
        names, values = self._measure(engine, optimizers, device, step)
        names.append("memory/monitor_seconds")
        values.append(time.perf_counter() - start)
        at = engine.units[0].flat_param.device if engine.units else torch.device("cpu")
        mine = torch.tensor(values, dtype=torch.float64, device=at)
        staged = engine.pipeline_group is not None  # every stage's ranks, over the whole run
        group, ranks = (None, dist.get_world_size()) if staged else (engine.group, engine.world_size)
        every_rank = torch.empty(mine.numel() * ranks, dtype=torch.float64, device=at)
        collectives.all_gather(every_rank, mine, group)  # one collective, every rank's values
        stages = _stages_of_ranks(engine) if staged else None
        self.cost_s.append(time.perf_counter() - start)
        if log is not None:
            table = every_rank.view(ranks, -1).tolist()
            where = (lambda r: f"{stages[r]}/rank{r}") if stages is not None else (lambda r: f"rank{r}")
            metrics = {f"{name}/{where(r)}": row[i] for r, row in enumerate(table) for i, name in enumerate(names)
                       if row[i] == row[i]}  # NaN: not known on this rank
            held = [sum(row[i] for i, name in enumerate(names) if name.endswith("/optimizer_state_bytes"))
                    for row in table]
            if sum(held) > 0:  # the largest rank's optimizer state over the mean (1.0: even)
                metrics["memory/optimizer_state_imbalance"] = max(held) / (sum(held) / len(held))
            log(metrics, step)

    def _measure(self, engine: Any, optimizers: list, device: torch.device, step: int) -> tuple[list[str], list[float]]:
        by_store = model_state_bytes(engine, optimizers)
        names, values = [], []
        stores = sorted({s.memory for s in engine.stores} | {"device"} | ({"nvme"} if "nvme" in by_store else set()))
        for store in stores:
            for kind in KINDS:
                names.append(f"memory/{store}/{kind}_bytes")
                values.append(float(by_store.get(store, {}).get(kind, 0)))
        names.append("memory/model_states_bytes")
        values.append(float(sum(v for s in by_store.values() for k, v in s.items() if k != "buffers")))
        names.append("memory/model_states_expected_bytes")
        states = engine_state_bytes(engine, optimizers)
        values.append(_expected(engine, optimizers, states))
        names.append("memory/optimizer_state_expected_bytes")
        values.append(float("nan") if states is None else float(states[engine.rank]))
        peak_name, peak = _peak(device)
        names.append(peak_name)
        values.append(peak)
        chosen = getattr(getattr(engine, "auto_schedule", None), "record", None)
        for key in SCHEDULE:  # NaN until chosen (after the second step), and for other schedules
            names.append(f"memory/schedule/{key}")
            value = chosen.get(key) if chosen is not None else None
            values.append(float("nan") if value is None else float(value))
        now, steps = _traffic(engine), max(1, step - self._steps_at)
        for kind in TRAFFIC:
            names.append(f"comm/{kind}_bytes_per_step")
            values.append((now[kind] - self._traffic_at.get(kind, 0)) / steps)
        self._traffic_at, self._steps_at = now, step
        reset_peak(device)
        return names, values


def _stages_of_ranks(engine: Any) -> list[str]:
    """Each global rank's stages as the metric names say them (``stage0``, ``stage1+3``): pipeline rank p (global
    ranks p x N x T onwards, pipeline outermost) runs stages p, p + P, ... ([Note: the pipeline dimension] in
    lzero/engine/mesh.py), as many as this rank does."""
    from lzero.engine.pipeline import local_stages

    size, world = engine.mesh.pipeline_size, dist.get_world_size()
    stages = size * len(engine.pipeline_stages)
    return ["stage" + "+".join(map(str, local_stages(r // (world // size), size, stages))) for r in range(world)]


def _traffic(engine: Any) -> dict[str, int]:
    out = dict.fromkeys(TRAFFIC, 0)
    out.update(collectives.TRAFFIC)
    for store in engine.stores if engine is not None else []:
        for kind, nbytes in getattr(store, "copied", {}).items():
            out[kind] += nbytes
        files = getattr(store, "files", None)
        if files is not None:
            out["nvme_read"] += files.bytes_read
            out["nvme_write"] += files.bytes_written
    return out


def _expected(engine: Any, optimizers: list, states: Optional[list[int]]) -> float:
    """The formula's model states of this rank between steps, its optimizer state ``states[rank]`` ([Note: optimizer
    state by rank] in optimizer_states.py; NaN where the optimizer's state is not known)."""
    from lzero.memory.estimate import ModelCount, model_states

    if states is None or not engine.units:
        return float("nan")
    master = engine.units[0].master_dtype
    precision = "bf16-mixed" if engine.mixed else "32-true" if master == torch.float32 else None
    if precision is None:
        return float("nan")
    trainable = sum(s.numel for u in engine.units if not u.spec.frozen for s in u.spec.params)
    frozen = sum(s.numel for u in engine.units if u.spec.frozen and not u.spec.storage for s in u.spec.params)
    quantized_as = [(b.kind, b.weights) for u in engine.units if u.spec.storage for b in u.bindings or ()]
    whole = 0  # bytes outside the formula: parameters no unit holds in a dtype it does not count them in
    compute_bytes = 2 if engine.mixed else 4
    for p, outside in engine.outside_units():  # stages 1-2: the frozen parameters, whole in the compute dtype
        if engine.config.stage < 3 and outside.kind is not None:  # a quantized base (QLoRA)
            quantized_as.append((outside.kind, outside.weights))
        elif engine.config.stage < 3 and p.is_floating_point() and p.element_size() == compute_bytes:
            frozen += p.numel()
        else:  # stage 3: another dtype than the units'; or a dtype the formula does not count in
            whole += p.numel() * p.element_size() + sum(t.numel() * t.element_size() for t in outside.state)
    kinds = {kind for kind, _ in quantized_as}
    if len(kinds) > 1:
        return float("nan")
    quantized = sum(weights for _, weights in quantized_as)
    count = ModelCount(trainable, frozen + quantized, quantized=quantized, **({"quantization": kinds.pop()} if kinds else {}))
    secondary = engine.gatherer.secondary if engine.gatherer is not None else None
    expected = model_states(engine.config, count, engine.world_size, precision, optimizer_bytes=0,
                            secondary=secondary.held() if secondary is not None else None)
    padding = sum(padding_bytes(engine.config, [u.spec for u in engine.units], engine.world_size, compute_bytes,
                                engine.mixed).values())
    return float(sum(v for kinds in expected.values() for k, v in kinds.items() if k != "gradients")) \
        + states[engine.rank] + padding + whole


def _peak(device: torch.device) -> tuple[str, float]:
    peak = peak_bytes(device)
    name = "memory/peak_device_bytes" if device.type == "cuda" else "memory/peak_rss_bytes"
    return name, float("nan") if peak is None else float(peak)
