"""The DeepSpeed configuration keys lzero knows, grouped by their fate (see [Note: reading a DeepSpeed
configuration] in config.py). Keys and defaults follow DeepSpeed 0.19 (``deepspeed/runtime/zero/config.py``
and neighbours); README's migration table names every one (tests/deepspeed/test_deepspeed_config.py checks it)."""

from __future__ import annotations

import sys

LOGGING_KEYS = ("wall_clock_breakdown", "steps_per_print", "flops_profiler", "tensorboard", "comms_logger", "wandb",
                "csv_monitor", "dump_state", "memory_breakdown", "timers", "monitor_config", "comet", "log_level",
                "dataloader_drop_last", "checkpoint")
"""Top-level keys that only configure DeepSpeed's own logging and tooling (its dataloader, ``deepspeed_io``; its
checkpoint engine's tag validation and storage options, where lzero's sharded checkpoints always resume at any
world size): accepted with one notice."""

NOT_BUILT_TOP = {
    "amp": "NVIDIA Apex AMP is not supported; use the `bf16` or `fp16` block",
    "sparse_attention": "DeepSpeed's sparse attention kernels are not part of lzero",
    "compression_training": "DeepSpeed's compression library is not part of lzero",
    "data_efficiency": "DeepSpeed's data-efficiency library is not part of lzero",
    "curriculum_learning": "DeepSpeed's curriculum learning is not part of lzero",
    "elasticity": "DeepSpeed's elastic training is not part of lzero",
    "autotuning": "DeepSpeed's autotuner is not part of lzero",
    "sparse_gradients": "sparse gradients are not supported by lzero's flat units",
    "torch_autocast": "DeepSpeed's torch-autocast mode is not built; lzero's `bf16`/`fp16` blocks autocast with 16-bit"
                      " parameter copies and fp32 masters",
    "hybrid_engine": "DeepSpeed's RLHF hybrid engine is not part of lzero",
    "expert_parallel": "expert (MoE) parallelism is not part of lzero",
    "use_data_before_expert_parallelism": "expert (MoE) parallelism is not part of lzero",
    "sequence_parallel_size": "sequence parallelism is not part of lzero",
    "eigenvalue": "DeepSpeed's eigenvalue-based quantization schedule is not part of lzero",
    "progressive_layer_drop": "progressive layer drop is not part of lzero",
    "quantize_training": "DeepSpeed's quantized training is not part of lzero",
    "weight_quantization": "DeepSpeed's weight quantization is not part of lzero",
    "nebula": "Azure Nebula checkpointing is not part of lzero",
    "datastates": "DataStates checkpointing is not part of lzero",
    "compile": "DeepSpeed's compile backend is not built; `torch.compile` the model's blocks yourself (lzero supports it)",
    "graph_harvesting": "CUDA-graph harvesting of the optimizer is not built",
    "disable_allgather": "lzero always all-gathers the updated partitions",
    "managed_gradient_accumulation": "lzero accumulates through the Trainer's `accumulate_grad_batches`",
    "gradient_allreduce_op": "lzero averages gradients (reduce-scatter of the sum, divided by the world size)",
}
"""Top-level keys of features lzero does not have: refused by name, except a block switched off
(``{"enabled": false}``), which asks for nothing."""

ZERO_PLUS_PLUS = {  # key -> the value that means "off"
    "zero_hpz_partition_size": 1, "zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False, "mics_shard_size": -1, "mics_hierarchical_params_gather": False,
    "zeropp_loco_param": None,
}
"""ZeRO++ and MiCS: accepted at their "off" value; MiCS's two keys are read as hybrid sharding (``shard_group_size``),
ZeRO++'s in ``ZERO_PLUS_PLUS_READ`` as lzero's fields; the others refused as not built otherwise."""

ZERO_PLUS_PLUS_READ = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients")
"""hpZ -> ``hpz_partition_size``, qwZ -> ``quantized_weights``, qgZ -> ``quantized_gradients`` (true: 4 bits)."""

STAGE3_SCHEDULE = {  # DeepSpeed key -> ZeroConfig field, both in elements
    "stage3_prefetch_bucket_size": "prefetch_bucket_size", "stage3_param_persistence_threshold":
    "param_persistence_threshold", "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
}
"""Stage-3 scheduling knobs: when parameters are gathered and how long they stay, never what is computed.
Honoured by lzero's gather schedule ([Note: stage-3 gather schedule] in gather.py); stage 3 only."""

ZERO_ONLY_VALUE = {  # key -> (the one value lzero runs, why)
    "contiguous_gradients": (True, "lzero's gradients always live in contiguous flat unit buffers"),
    "reduce_scatter": (True, "lzero always reduce-scatters gradients (an all-reduce would defeat stage 2-3)"),
    "allgather_partitions": (True, "lzero always all-gathers the updated partitions"),
    "load_from_fp32_weights": (True, "lzero always resumes the fp32 master weights from the checkpoint"),
    "round_robin_gradients": (False, "round-robin gradient copies to the host are not built"),
    "ignore_unused_parameters": (True, "lzero never fails on unused parameters (see ZeroConfig.find_unused_parameters)"),
    "stage3_model_persistence_threshold": (sys.maxsize, "persistent small models are not built"),
    "stage3_module_granularity_threshold": (0, "module-granularity leaf units are not built; lzero's units are"
                                               " chosen with `unit_modules`"),
    "stage3_use_all_reduce_for_fetch_params": (False, "lzero gathers parameters with all-gather"),
    "stage3_allgather_sequential": (False, "lzero coalesces gathers by `allgather_bucket_size`"),
}

ZERO_NOTICE = {  # key -> what lzero does instead
    "elastic_checkpoint": "lzero's sharded checkpoints always resume at any world size and stage",
    "use_multi_rank_bucket_allreduce": "lzero reduce-scatters one unit per collective",
    "memory_efficient_linear": "lzero keeps torch's own Linear autograd",
    "stage3_gather_16bit_weights_on_model_save": "lzero has no `save_16bit_model`; consolidated weights come from"
                                                 " `lzero consolidate` or `checkpoint_format='full'`",
}

ZERO_RENAMED = {
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}

ZERO_SIZES = {"reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
              "sub_group_size": "sub_group_size"}
"""Keys with the same name and unit (elements) in ZeroConfig; ``"auto"`` is kept for the hidden-size sizes (auto_sizes.py)
and refused for the others."""

ZERO_KEYS = ("stage", "overlap_comm", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params",
             "cpu_offload_use_pin_memory", *ZERO_SIZES, *ZERO_PLUS_PLUS, *STAGE3_SCHEDULE, *ZERO_ONLY_VALUE,
             *ZERO_NOTICE, *ZERO_RENAMED)

FP16_KEYS = ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale")
LOSS_SCALE_KEYS = FP16_KEYS[2:]
"""The ``fp16`` keys that are :class:`lzero.LossScaleConfig` fields of the same name."""

ONLY_DEFAULT_TOP = {"prescale_gradients": (False,), "gradient_predivide_factor": (1.0,),
                    "communication_data_type": (None, "fp32"), "fp32_allreduce": (False, True),
                    "data_types": (None, {}, {"grad_accum_dtype": None}, {"grad_accum_dtype": "fp32"})}
"""Top-level keys lzero runs only at these values. lzero reduces gradients in fp32 under every precision a DeepSpeed
configuration can ask for (fp32, and the fp16/bf16 mixed precisions) and accumulates them in fp32, so
``communication_data_type: fp32``, ``fp32_allreduce: true`` and ``data_types: {grad_accum_dtype: fp32}`` are what it
does; ``fp32_allreduce: false`` (DeepSpeed's default) is accepted with a notice.
The rest is refused by name."""

TENSOR_PARALLEL_KEYS = ("autotp_size", "tp_size", "partition_config", "tp_overlap_comm", "dtype", "tp", "preset_model",
                        "injection_policy_tuple", "keep_module_on_host", "replace_with_kernel_inject", "kernel_inject")
"""The ``tensor_parallel`` block's keys (DeepSpeed's ``TPTrainingConfig``, plus the seeds' ``tp_size``): ``autotp_size``
(and ``tp_size``, read as it with a notice) and ``partition_config`` honoured, ``tp_overlap_comm: false`` accepted,
the rest refused by name (see ``_Reader.tensor_parallel`` in config.py)."""

PIPELINE_KEYS = ("stages", "pp_size", "micro_batch_size", "partition", "activation_checkpoint_interval", "seed_layers",
                 "pipe_partitioned", "grad_partitioned", "use_reentrant")
"""The ``pipeline`` block's keys (DeepSpeed's ``PipelineEngine`` reads ``stages``, ``partition``, ``seed_layers``,
``activation_checkpoint_interval``, ``pipe_partitioned``, ``grad_partitioned``, ``use_reentrant``; the seeds write
``pp_size`` and ``micro_batch_size``): see ``_Reader.pipeline`` in config.py."""

TOP_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization",
            "fp16", "bf16", "bfloat16", "gradient_clipping", "activation_checkpointing", "aio",
            "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "optimizer", "scheduler", "tensor_parallel",
            "pipeline",
            *ONLY_DEFAULT_TOP, *LOGGING_KEYS, *NOT_BUILT_TOP)
