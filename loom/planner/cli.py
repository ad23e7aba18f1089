"""``loom plan``: predict memory and speed of every parallel layout and pick the best.

Examples::

    loom plan gpt3-175b --gpu A100-80GB --num-gpus 1024 --global-batch-size 1536
    loom plan llama3-70b --gpu H100-80GB --num-gpus 256 --global-batch-size 512 \\
        --tensor-model-parallel-size 8 --json
    loom plan --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --vocab-size 50304 \\
        --seq-length 4096 --num-gpus 64 --global-batch-size 512 --plot layouts.png
    loom plan --calibrate --calibrate-output local.json   # then: loom plan ... --cluster local.json
    loom plan mixtral-8x7b --gpu H100-80GB --num-gpus 64 --moe-load-imbalance 1.2

Model: a preset name or the Megatron-style flags / ``--config FILE.yaml`` of ``loom train``
(preset values are overridden by flags given). Any parallel flag given fixes that dimension.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import fields, replace

from loom.config import (ConfigError, ModelConfig, add_config_arguments, config_from_args,
                         read_yaml_config)
from loom.planner.options import PLAN_OPTIONS
from loom.planner.hardware import GB, Cluster, make_cluster
from loom.planner.cost import format_estimate, parse_count, training_estimate
from loom.planner.cli_args import (cp_a2a_size_of, cp_comm_type_of, fixed_from_args,
                                   gradient_option, optimizer_option, unmodelled_note)
from loom.planner.command import LEGEND, hf_model_config, optimizer_flags, train_command
from loom.planner.layout import Options, given_buckets
from loom.planner.memory import total_params
from loom.planner.mamba import is_hybrid, kind_counts
from loom.planner.moe import load_imbalance
from loom.planner.presets import PRESETS, get_preset


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``loom plan`` flags: a model preset, its own options (declared above with ``opt()``, as
    the config sections are) and every config flag of ``loom train``."""
    from loom.config.args import add_options
    parser.allow_abbrev = False  # --num-gpu must not silently mean --num-gpus
    parser.add_argument("model", nargs="?", default=None,
                        help=f"model preset: {', '.join(PRESETS)} (or give the model flags)")
    for title, options in PLAN_OPTIONS:
        add_options(parser, options, title)
    add_config_arguments(parser)


def plan_options(args) -> None:
    """The plan options not given take their declared defaults (in ``args``), checked against
    their bounds (ConfigError naming the flag)."""
    from loom.config.args import options_from_args
    for _, options in PLAN_OPTIONS:
        for k, v in vars(options_from_args(args, options)).items():
            setattr(args, k, v)


_MODEL_FIELDS = {f.name for f in fields(ModelConfig)}


def _model_from_args(args) -> tuple[ModelConfig, str, dict]:
    """The model, its name and the no-effect Megatron flags given
    (``LoomConfig.megatron_no_effect``)."""
    cfg = config_from_args(args)  # YAML + flags
    if args.model or args.from_hf:
        base = hf_model_config(args.from_hf) if args.from_hf else get_preset(args.model)
        given = {k: v for k, v in vars(args).items() if k in _MODEL_FIELDS and v is not None}
        if args.config:  # YAML model keys override the preset too
            given = {**{k: getattr(cfg.model, k) for k in _MODEL_FIELDS
                        if getattr(cfg.model, k) != getattr(ModelConfig(), k)}, **given}
        if "seq_length" in given and "max_position_embeddings" not in given:
            given["max_position_embeddings"] = max(given["seq_length"], base.max_positions)
        model = replace(base, **given)
        name = args.model or os.path.basename(os.path.dirname(os.path.abspath(args.from_hf))) \
            or args.from_hf
    else:
        model = cfg.model
        name = "custom"
    if not model.vocab_size:
        raise ConfigError("--vocab-size is required for the planner (or use a preset)")
    model = _hybrid_depth(model, args)
    no_effect = dict(cfg.megatron_no_effect)
    if cfg.config_notes:  # a torchtitan TOML's differences, said as loom train says them
        no_effect["config_notes"] = list(cfg.config_notes)
    h, a, g = model.hidden_size, model.num_attention_heads, model.num_kv_groups
    if None in (a, h, model.num_layers):
        raise ConfigError("--num-layers, --hidden-size and --num-attention-heads are required "
                          "for the planner (or use a preset, --from-hf or "
                          "--hybrid-layer-pattern for the depth)")
    if a < 1 or h < 1 or model.num_layers < 1:
        raise ConfigError("--num-layers, --hidden-size and --num-attention-heads must be >= 1")
    if not model.kv_channels and h % a:
        raise ConfigError(f"--num-attention-heads {a} does not divide --hidden-size {h}: choose a "
                          f"head count that divides it (e.g. {_near_divisor(h, a)}) or give "
                          f"--kv-channels")
    if a % g:
        raise ConfigError(f"--num-query-groups {g} does not divide --num-attention-heads {a}: "
                          f"choose a divisor of {a}")
    return model, name, no_effect


def _hybrid_depth(model: ModelConfig, args) -> ModelConfig:
    """``model`` with the depth its ``--hybrid-layer-pattern`` sets (as loom train reads it,
    :func:`loom.config.hybrid_pattern.resolve_hybrid_pattern`: ``--num-layers`` is then
    ignored), or with the pattern earlier releases' shares allocate (``hybrid_attention_ratio``,
    ``hybrid_mlp_ratio``); ``|`` pipeline segments set ``args``' split flags as they set loom
    train's. ConfigError for segments without ``--pipeline-model-parallel-size``."""
    from loom.config.hybrid_pattern import resolve_hybrid_pattern
    pat = model.hybrid_override_pattern
    if not pat and not (model.hybrid_attention_ratio or model.hybrid_mlp_ratio):
        return model
    pat = pat or ""
    if "|" in pat and not args.pipeline_model_parallel_size:
        raise ConfigError(f"--hybrid-layer-pattern {pat!r} cuts {pat.count('|') + 1} pipeline "
                          f"segments (|): give --pipeline-model-parallel-size (a divisor of "
                          f"{pat.count('|') + 1}) or drop the |")
    model = replace(model)
    resolve_hybrid_pattern(model, args)
    return model


def _near_divisor(n: int, k: int) -> int:
    """The divisor of ``n`` closest to ``k``."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - k), d))


def _cluster_from_args(args) -> Cluster:
    for flag, v in (("--num-gpus", args.num_gpus), ("--gpus-per-node", args.gpus_per_node)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} {v}: must be >= 1; give the GPUs of the job, "
                              f"e.g. {flag} 8")
    bw = lambda x: None if x is None else x * 1e9  # noqa: E731  GB/s -> bytes/s
    if args.cluster:
        cl = Cluster.load(args.cluster)
        if args.gpu:
            g = make_cluster(args.gpu)
            cl = replace(cl, gpu=g.gpu, peak_flops=g.peak_flops, hbm_bytes=g.hbm_bytes,
                         hbm_bw=g.hbm_bw)
        over = dict(num_gpus=args.num_gpus, gpus_per_node=args.gpus_per_node,
                    intra_bw=bw(args.intra_node_bandwidth), inter_bw=bw(args.inter_node_bandwidth))
        return replace(cl, **{k: v for k, v in over.items() if v is not None})
    return make_cluster(args.gpu or "A100-80GB", args.num_gpus or 8, args.gpus_per_node,
                        intra_bw=bw(args.intra_node_bandwidth),
                        inter_bw=bw(args.inter_node_bandwidth))


def check_train_bounds(args) -> None:
    """loom train's bounds (``ge``/``gt``/``lt``/``le`` of each config field,
    :func:`loom.config.validate.check_bounds`) on the loom train flags given to loom plan, so
    that a value loom train refuses is refused here too, naming the flag, before any search
    (``--optimizer-offload-fraction 1.5`` was planned and printed). Raises ConfigError."""
    from dataclasses import fields

    from loom.config import GROUPS
    from loom.config.validate import check_bounds
    for section in GROUPS.values():
        for f in fields(section):
            value = getattr(args, f.name, None)
            if isinstance(value, (int, float)):
                check_bounds(f.name, value, f.metadata)


def run(args) -> int:
    plan_options(args)
    if args.calibrate:
        from loom.planner.calibrate import calibrate_local
        cl = calibrate_local(args.calibrate_output)
        print(f"wrote {args.calibrate_output}: GEMM peak {cl.peak_flops / 1e12:.3g} TFLOP/s x "
              f"efficiency {cl.gemm_efficiency:.2f} (fitted), memory bandwidth "
              f"{cl.hbm_bw / 1e9:.3g} GB/s, non-GEMM traffic factor {cl.mem_traffic:.3g}, "
              f"all-reduce alpha {cl.intra_alpha * 1e6:.1f} us, bandwidth "
              f"{cl.intra_bw / 1e9:.3g} GB/s")
        if not args.model and not args.num_layers:
            return 0
    from loom.planner.diagnose import explain_no_layout, explain_nothing_fits
    from loom.planner.report import (format_breakdown, format_table, plot, plot_breakdown,
                                     to_json, top_records)
    from loom.planner.search import record, search

    t0 = time.perf_counter()
    if args.config:  # the file's batch and parallel sizes fix the search like flags do
        for key, value in read_yaml_config(args.config, overrides=getattr(
                args, "torchtitan_set", None)).items():
            if getattr(args, key, None) is None:
                setattr(args, key, value)
    model, name, no_effect = _model_from_args(args)
    cluster = _cluster_from_args(args)
    B = args.global_batch_size
    if B is not None and B < 1:
        raise ConfigError(f"--global-batch-size {B}: must be >= 1 (sequences per iteration)")
    if B is None:
        B = default_global_batch(args, cluster.num_gpus)
    train_tokens = parse_count(args.train_tokens) if args.train_tokens else None
    _check_estimate_inputs(args, train_tokens)
    check_train_bounds(args)  # after loom plan's own, more particular messages
    s = model.seq_length
    flash = args.attention != "unfused"
    if args.moe_load_imbalance < 1:
        raise ConfigError(f"--moe-load-imbalance {args.moe_load_imbalance}: must be >= 1 (the "
                          f"busiest rank's expert tokens over the mean; 1 = perfect balance)")
    overlap = dp_overlap_of(args)
    opts = Options(flash_attention=flash, causal_skip=args.attention == "cudnn",
                   allow_tp_across_nodes=args.allow_tp_across_nodes,
                   # --no-overlap-grad-reduce / --no-overlap-param-gather turn one of them off
                   overlap_grad_reduce=overlap and args.overlap_grad_reduce is not False,
                   overlap_param_gather=overlap and args.overlap_param_gather is not False,
                   # Muon orthogonalizes whole matrices: no FSDP (ZeRO-3), as loom train refuses
                   max_zero_stage=min(args.max_zero_stage, 2) if (
                       args.optimizer or "adam").endswith("muon") else args.max_zero_stage,
                   uneven_interleaved=True,
                   straggler_jitter=args.straggler_jitter,
                   moe_load_imbalance=load_imbalance(model, args.moe_load_imbalance),
                   cp_comm_type=cp_comm_type_of(args), cp_a2a_size=cp_a2a_size_of(args),
                   layer_memory=args.layer_memory,
                   **given_buckets(args.ddp_bucket_size), **optimizer_option(args),
                   **gradient_option(args))
    # what the planner prices, and the command says it; --no-bf16 alone asks for fp32 (named)
    precision = "fp16" if args.fp16 else (None if args.bf16 is False else "bf16")
    for note in unmodelled_note(args, no_effect, model):
        print(f"loom plan: warning: {note}", file=sys.stderr)
    calibration = None
    if args.calibrate_from:  # the user's measured runs fit e, k and the memory reserve
        from loom.planner.calibrate_runs import calibrate
        from loom.planner.measured_runs import read_runs
        cluster, opts, calibration = calibrate(model, cluster, read_runs(args.calibrate_from),
                                               B, s, opts)
    fixed = fixed_from_args(args, model)
    res = search(model, cluster, B, s, fixed, opts)
    n_eval, n_fit = len(res["tp"]), len(res["order"])
    elapsed = time.perf_counter() - t0
    moe = (f", {total_params(model, active=True) / 1e9:.3g}B active, E={model.num_experts} "
           f"k={model.moe_router_topk} expert ffn={model.moe_ffn_size}"
           + (f" shared={model.moe_shared_expert_intermediate_size}"
              if model.moe_shared_expert_intermediate_size else "")
           + f" imbalance {opts.moe_load_imbalance:g}"
           + (" (--moe-expert-capacity-factor)"
              if opts.moe_load_imbalance < args.moe_load_imbalance else "")
           if model.num_experts else "")
    attn = f"a={model.num_attention_heads} g={model.num_kv_groups} "
    ffn = f"ffn={model.ffn_size} "
    if is_hybrid(model):  # layers of each kind and the Mamba-2 sizes (a, g, ffn if used)
        n_kind = kind_counts(model)
        attn, ffn = (attn if n_kind["*"] else ""), (ffn if n_kind["-"] else "")
        moe += (", layers " + " ".join(f"{k}{n}" for k, n in kind_counts(model).items() if n)
                + f" (Mamba N={model.mamba_state_dim} P={model.mamba_head_dim} "
                  f"G={model.mamba_num_groups} d_inner={model.mamba_d_inner} "
                  f"Q={model.mamba_chunk_size})")
    header = (f"loom plan: {name} ({total_params(model) / 1e9:.3g}B params{moe}, "
              f"L={model.num_layers} h={model.hidden_size} {attn}{ffn}"
              f"V={model.vocab_size} s={s}) on {cluster.num_gpus} x "
              f"{cluster.gpu} ({cluster.gpus_per_node}/node, {cluster.hbm_bytes / GB:.0f} GB, "
              f"{cluster.peak_flops / 1e12:.3g} TFLOP/s), B={B}, "
              f"{args.attention or 'fused'} attention"
              f"{' and Mamba scan' if is_hybrid(model) else ''}; "
              f"{n_fit} of {n_eval} layouts fit ({elapsed:.2f} s)")
    recs = top_records(res, None if (args.json and args.top <= 0) else max(args.top, 1))
    if recs and not args.json and not 1 <= args.command_for <= len(recs):  # before any output
        raise ConfigError(f"--command-for {args.command_for}: the table has rows "
                          f"1..{len(recs)} (raise --top to see more)")
    if train_tokens:
        for r in recs:
            r["training"] = _estimate(args, r, cluster, train_tokens, total_params(model))
    why = None
    if not n_eval:
        why = explain_no_layout(model, cluster, B, s, fixed, opts)
    elif not n_fit:
        why = explain_nothing_fits(model, cluster, B, s, fixed, opts, res)
    if args.json:
        doc = {"model": name, "gpu": cluster.gpu, "num_gpus": cluster.num_gpus,
               "global_batch_size": B, "seq_length": s, "evaluated": n_eval, "feasible": n_fit,
               "params": total_params(model), "active_params": total_params(model, active=True)}
        if why:
            doc["error"] = why
        if calibration:
            doc["calibration"] = calibration
        if not n_fit and n_eval:  # the given layout still gets its predicted time
            doc["closest"] = record(res, int(res["mem_total"].argmin()))
        for r in recs:
            r["command"] = train_command(r, model, B, s, cluster.num_gpus, cluster.gpus_per_node,
                                         opts, precision, optimizer_flags(args))
        print(to_json(recs, doc))
    else:
        if calibration:
            from loom.planner.calibrate_runs import format_report
            print("\n".join(format_report(calibration, args.calibrate_from)))
        print(format_table(recs, header) if recs else header)
        if recs:
            print(format_breakdown(recs[:min(len(recs), 5)]))
            if "training" in recs[0]:
                print("chosen layout: " + format_estimate(recs[0]["training"]))
            print(LEGEND)
            n = args.command_for
            print(f"command for row {n}{' (the chosen layout)' if n == 1 else ''}; add "
                  f"--data-path PREFIX (or --mock-data to try it), --train-iters N and --lr X:")
            print(train_command(recs[n - 1], model, B, s, cluster.num_gpus,
                                cluster.gpus_per_node, opts, precision, optimizer_flags(args)))
    if why:
        print(f"loom plan: {why}", file=sys.stderr)
    if args.plot:
        plot(res, args.plot, title=f"{name} on {cluster.num_gpus} x {cluster.gpu}, B={B}",
             chosen=recs[0] if recs else None, capacity_gb=cluster.hbm_bytes / 1e9)
        if not args.json:
            print(f"wrote {args.plot}")
    if args.plot_breakdown and recs:
        plot_breakdown(recs[:min(len(recs), 8)], args.plot_breakdown,
                       title=f"{name} on {cluster.num_gpus} x {cluster.gpu}, B={B}, s={s}")
        if not args.json:
            print(f"wrote {args.plot_breakdown}")
    return 0 if n_fit else 1


def default_global_batch(args, num_gpus: int) -> int:
    """B without ``--global-batch-size``: what ``loom train`` would run (Megatron's default,
    ``--micro-batch-size`` x d, one micro-batch) when the micro-batch and the TP / PP / CP
    sizes are all given (a torchtitan config gives them: its local batch x its data-parallel
    size), else 1,024 rounded up to a multiple of the GPUs."""
    sizes = (args.micro_batch_size, args.tensor_model_parallel_size,
             args.pipeline_model_parallel_size, args.context_parallel_size)
    if None not in sizes:
        b, t, p, c = (int(v) for v in sizes)
        if num_gpus % (t * p * c) == 0:
            return b * (num_gpus // (t * p * c))
    return -(-1024 // num_gpus) * num_gpus


def dp_overlap_of(args) -> bool:
    """``--dp-overlap on|off`` as a bool (both ``Options.overlap_grad_reduce`` and
    ``overlap_param_gather``). ``--overlap-grad-reduce`` / ``--overlap-param-gather`` given
    (flags or ``--config``) agree with on; with off they are a contradiction (ConfigError);
    their ``--no-`` spellings turn that one off under on (:func:`run`)."""
    given = [f for f, k in (("--overlap-grad-reduce", "overlap_grad_reduce"),
                            ("--overlap-param-gather", "overlap_param_gather"))
             if getattr(args, k, None)]
    if args.dp_overlap == "off" and given:
        raise ConfigError(f"--dp-overlap off plans exposed data-parallel communication, but "
                          f"{' and '.join(given)} overlaps it: drop one of them")
    return args.dp_overlap == "on"


MAX_TRAIN_TOKENS = 1e18  # a million times the largest published pre-training runs (~1e13)


def _check_estimate_inputs(args, train_tokens) -> None:
    """Refuse a negative or non-finite price or power, a zero MTBF and an absurd token count
    (their estimates would be negative, infinite or NaN). Raises ConfigError naming the flag."""
    if train_tokens is not None and not train_tokens <= MAX_TRAIN_TOKENS:
        raise ConfigError(f"--train-tokens {args.train_tokens}: more than {MAX_TRAIN_TOKENS:.0e} "
                          f"tokens, beyond any training run; give e.g. 300B or 15T")
    for flag, value, low in (("--gpu-hour-price", args.gpu_hour_price, 0.0),
                             ("--gpu-tdp-watts", args.gpu_tdp_watts, 0.0),
                             ("--pue", args.pue, 1.0),
                             ("--node-power-overhead", args.node_power_overhead, 0.0),
                             ("--mtbf-hours-per-node", getattr(args, "mtbf_hours_per_node", None),
                              None),
                             ("--checkpoint-write-bandwidth",
                              getattr(args, "checkpoint_write_bandwidth", None), None),
                             ("--restart-minutes", getattr(args, "restart_minutes", None), 0.0)):
        if value is None:
            continue
        bad = not math.isfinite(value) or (value <= 0 if low is None else value < low)
        if bad:
            need = "a positive number" if low is None else f"a finite number >= {low:g}"
            raise ConfigError(f"{flag} {value}: give {need}")


def _estimate(args, rec: dict, cluster: Cluster, train_tokens: float, params: float) -> dict:
    bw = args.checkpoint_write_bandwidth
    return training_estimate(
        rec["tokens_per_s"], cluster.num_gpus, train_tokens, params,
        tdp_w=args.gpu_tdp_watts or cluster.tdp_w, gpus_per_node=cluster.gpus_per_node,
        node_overhead=args.node_power_overhead, pue=args.pue,
        gpu_hour_price=args.gpu_hour_price, mtbf_hours_per_node=args.mtbf_hours_per_node,
        checkpoint_bw=None if bw is None else bw * 1e9, restart_s=args.restart_minutes * 60)


