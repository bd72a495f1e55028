"""What a job may ask of the engine: an allow-list of vLLM engine arguments, plain values only.

An allow-list (``JOB_ENGINE_ARGS``; every other argument is ``REGISTRY_ONLY_ENGINE_ARGS``,
with why), because a list of what is dangerous misses the next argument vLLM adds: a test
fails when vLLM knows an argument in neither set."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, ConfigDict, Field, StrictBool, ValidationError, create_model

_Count = Annotated[int, Field(ge=1, le=1_048_576)]
_Parallel = Annotated[int, Field(ge=1, le=64)]
_Seed = Annotated[int, Field(ge=0, lt=2**63)]

# vLLM 0.32's names (tests/unit/test_engine_args.py checks each is a subset of vLLM's own).
QUANTIZATION_METHODS = (
    "awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4", "modelopt_mxfp8", "modelopt_mixed",
    "auto_gptq", "gptq", "gptq_marlin", "awq_marlin", "humming", "compressed-tensors", "experts_int8", "quark",
    "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8", "online", "fp8_per_tensor",
    "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8",
)

# name -> the type of the values a job may give it (pydantic, strict where it matters).
JOB_ENGINE_ARGS: dict[str, Any] = {
    # How much the engine holds at once.
    "max_model_len": _Count,
    "max_num_seqs": Annotated[int, Field(ge=1, le=4096)],
    "max_num_batched_tokens": _Count,
    "long_prefill_token_threshold": Annotated[int, Field(ge=0, le=1_048_576)],
    "num_gpu_blocks_override": _Count,
    "block_size": Literal[1, 8, 16, 32, 64, 128, 256],
    "gpu_memory_utilization": Annotated[float, Field(gt=0, le=1)],
    "max_logprobs": Annotated[int, Field(ge=-1, le=1000)],
    # Parallelism inside one worker (checked against the job's gpus and nodes).
    "tensor_parallel_size": _Parallel,
    "pipeline_parallel_size": _Parallel,
    # Scheduling and caching switches.
    "enable_prefix_caching": StrictBool,
    "enable_chunked_prefill": StrictBool,
    "disable_sliding_window": StrictBool,
    "disable_cascade_attn": StrictBool,
    "async_scheduling": StrictBool,
    # The deployment's LLM_BATCH_ENFORCE_EAGER=true still wins (model_resolution.job_engine_args).
    "enforce_eager": StrictBool,
    "scheduling_policy": Literal["fcfs", "priority"],
    "performance_mode": Literal["balanced", "interactivity", "throughput"],
    "prefix_caching_hash_algo": Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
    # Numerics and sampling.
    "seed": _Seed,
    "dtype": Literal["auto", "half", "float16", "bfloat16", "float", "float32"],
    "kv_cache_dtype": Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc",
                              "fp8_ds_mla", "nvfp4"],
    "quantization": Literal[QUANTIZATION_METHODS],  # type: ignore[valid-type]
    "logprobs_mode": Literal["raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs"],
    # What the checkpoint is run as (a checkpoint_path outside the registry names its task here).
    "runner": Literal["auto", "generate", "pooling"],
    "convert": Literal["auto", "none", "embed", "classify"],
    "tokenizer_mode": Literal["auto", "hf", "mistral"],
    "config_format": Literal["auto", "hf", "mistral"],
}

# Every other argument of vLLM 0.32's EngineArgs, and why a job may not set it.
_REGISTRY_ONLY = {
    "imports code, or loads a file or a checkpoint by name": """
        model model_weights tokenizer hf_config_path trust_remote_code download_dir load_format
        model_loader_extra_config ignore_patterns safetensors_load_strategy revision code_revision tokenizer_revision
        hf_token hf_overrides model_class_overrides model_impl quantization_config allow_deprecated_quantization
        generation_config override_generation_config reasoning_parser reasoning_parser_plugin reasoning_config
        io_processor_plugin logits_processors scheduler_cls worker_cls worker_extension_cls compilation_config
        attention_config kernel_config ir_op_priority structured_outputs_config aux_output_config pooler_config
        speculative_config spec_method spec_model spec_tokens diffusion_config watermark_config watermark
        mm_encoder_fp8_scale_path mm_encoder_fp8_scale_save_path mm_encoder_fp8_scale_save_margin log_config_file
        logging_config additional_config skip_tokenizer_init served_model_name enable_lora max_loras max_lora_rank
        default_mm_loras fully_sharded_loras max_cpu_loras lora_dtype lora_target_modules enable_tower_connector_lora
        specialize_active_lora enable_mixed_moe_lora_format enable_moe_shared_loras max_lora_cls_labels engram_config
        enable_prompt_embeds enable_mm_embeds tokens_only enable_trace_replay
    """,
    "reads local media or fetches URLs": """
        allowed_local_media_path allowed_media_domains media_io_kwargs
    """,
    "opens ports, addresses or telemetry endpoints": """
        master_addr master_port nnodes node_rank data_parallel_address data_parallel_rpc_port otlp_traces_endpoint
        collect_detailed_traces kv_transfer_config kv_events_config ec_transfer_config weight_transfer_config
        distributed_executor_backend distributed_timeout_seconds cpu_distributed_timeout_seconds
    """,
    "is the deployment's: devices, placement, parallel topology, memory beside the engine": """
        device_ids numa_bind numa_bind_nodes numa_bind_cpus prefill_context_parallel_size decode_context_parallel_size
        dcp_comm_backend dcp_q_replicate dcp_kv_cache_interleave_size cp_kv_cache_interleave_size data_parallel_size
        data_parallel_rank data_parallel_start_rank data_parallel_size_local data_parallel_hybrid_lb
        data_parallel_external_lb data_parallel_multi_port_external_lb data_parallel_backend enable_hc_sp
        enable_expert_parallel enable_batch_sharded_sampling enable_ep_weight_filter moe_backend linear_backend
        sparse_indexer_topk_backend all2all_backend enable_elastic_ep elastic_ep_max_dp_size enable_dbo ubatch_size
        dbo_decode_token_threshold dp_sync_interval dbo_prefill_token_threshold disable_nccl_for_dp_synchronization
        eplb_config enable_eplb expert_placement_strategy _api_process_count _api_process_rank
        max_parallel_loading_workers safetensors_prefetch_num_threads safetensors_prefetch_block_size cpu_offload_gb
        cpu_offload_params offload_backend offload_group_size offload_num_in_group offload_prefetch_step offload_params
        kv_cache_memory_bytes kv_offloading_size kv_offloading_backend disable_custom_all_reduce enable_shm_tensor_arena
        mm_processor_cache_gb mm_processor_cache_type mm_shm_cache_max_object_size_mb mm_encoder_tp_mode
        mm_encoder_attn_backend mm_encoder_attn_dtype mm_tensor_ipc mm_processor_device mm_ipc_gpu_memory_gb
        renderer_num_workers ray_workers_use_nsight enable_sleep_mode sleep_mode_offload_cudagraph
        sleep_preserve_parameter_names enable_cumem_allocator enable_nccl_comm_suspend pt_load_map_location
        attention_backend mamba_backend gdn_prefill_backend kda_prefill_backend kda_decode_backend
        enable_flashinfer_autotune optimization_level fault_tolerance_config enable_fault_tolerance shutdown_timeout
        fail_on_environ_validation profiler_config cudagraph_capture_sizes max_cudagraph_capture_size use_tqdm_on_load
    """,
    "changes what the engine reports or logs, not what it computes": """
        disable_log_stats aggregate_engine_logging show_hidden_metrics_for_version per_request_spec_decode_metrics
        kv_cache_metrics kv_cache_metrics_sample custom_histogram_buckets cudagraph_metrics
        enable_layerwise_nvtx_tracing enable_mfu_metrics enable_logging_iteration_details jit_monitor_mode
        jit_monitor_verbose enable_mm_processor_stats log_level stream_interval enable_return_routed_experts
        return_sampling_mask use_fp64_gumbel
    """,
    "is a model-family or multimodal tuning the registry entry sets for its model": """
        limit_mm_per_prompt mm_processor_kwargs mm_hasher_algorithm mm_encoder_only skip_mm_profiling video_pruning_rate
        video_pruning_method mm_device_do_normalize interleave_mm_strings disable_chunked_mm_input language_model_only
        scheduler_reserve_full_isl prefill_schedule_interval max_num_scheduled_tokens max_num_active_seqs
        max_num_queued_reqs max_num_queued_tokens prefix_cache_retention_interval disable_hybrid_kv_cache_manager
        kv_cache_dtype_skip_layers mamba_config mamba_cache_dtype mamba_ssm_cache_dtype mamba_block_size
        prefix_match_unit mamba_cache_mode enable_mamba_shared_prefix_checkpoint replayssm_buffer_len use_replayssm
        mamba_ssu_algorithm enable_mamba_cache_stochastic_rounding mamba_cache_philox_rounds kv_sharing_fast_prefill
        swa_bounded_replay long_prefill_token_threshold_adaptive ec_manager_config
    """,
}
REGISTRY_ONLY_ENGINE_ARGS: dict[str, str] = {
    name: why for why, names in _REGISTRY_ONLY.items() for name in names.split()
}


JobEngineArgs = create_model(
    "JobEngineArgs",
    __config__=ConfigDict(extra="forbid"),
    __doc__="The engine arguments a job may set (JOB_ENGINE_ARGS); any other name is refused.",
    __module__=__name__,
    **{name: (Optional[type_], None) for name, type_ in JOB_ENGINE_ARGS.items()},
)


def allowed_engine_args(value: dict[str, Any]) -> dict[str, Any]:
    """The engine arguments a job gave, typed; ValueError naming every argument a job may not
    set, and every value out of its bounds."""
    problems = []
    for name in value:
        if name in REGISTRY_ONLY_ENGINE_ARGS:
            problems.append(f"{name} may not be set by a job (the model registry may set it: it "
                            f"{REGISTRY_ONLY_ENGINE_ARGS[name]})")
        elif name not in JOB_ENGINE_ARGS:
            shown = name if _PLAIN_NAME.fullmatch(name) else _shown(name)
            problems.append(f"{shown} may not be set by a job: it is not on the allow-list of "
                            f"engine arguments ({', '.join(sorted(JOB_ENGINE_ARGS))})")
    if not problems:
        try:
            return JobEngineArgs.model_validate(value).model_dump(exclude_none=True)
        except ValidationError as exc:
            problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {_shown(e.get('input'))})"
                        for e in exc.errors()]
    raise ValueError("; ".join(problems))


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- small dicts handed to the engine --------------------------------------------------

_Key = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("a finite number")
    return value


_Scalar = (StrictBool | Annotated[int, Field(ge=-(2**63), lt=2**63)]
           | Annotated[float, AfterValidator(_finite)] | Annotated[str, Field(max_length=256)] | None)
_Leaf = _Scalar | Annotated[list[_Scalar], Field(max_length=32)]
# Up to 32 string keys, each a scalar, a list of up to 32 scalars, or one more such dict (no deeper).
PlainDict = Annotated[dict[_Key, _Leaf | Annotated[dict[_Key, _Leaf], Field(max_length=32)]], Field(max_length=32)]
