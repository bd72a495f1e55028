"""``llm-batch models list`` and ``llm-batch models prepare [NAME ...]``: the registry's models
and their LoRA adapters (an adapter's row names its base)."""

from __future__ import annotations

import argparse
import time

from llm_batch.cli import fail, print_table
from llm_batch.core.config import get_settings


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("models", help="list the model registry and prepare models for offline use")
    actions = parser.add_subparsers(dest="models_command", required=True)
    actions.add_parser("list", help="the registered models and whether each is ready").set_defaults(func=list_models)
    prepare = actions.add_parser("prepare", help="build registered models in the model cache (default: the default "
                                 "chat and embedding models); idempotent, fast when already done")
    prepare.add_argument("names", nargs="*", metavar="NAME", help="registered model or adapter names")
    prepare.add_argument("--force", action="store_true", help="rebuild even if ready")
    prepare.set_defaults(func=prepare_models)


def list_models(args: argparse.Namespace) -> int:
    from llm_batch.core.model_config import ModelError  # heavy
    from llm_batch.infra.adapters import adapter_status  # heavy
    from llm_batch.infra.model_cache import model_status  # heavy
    from llm_batch.infra.model_registry import load_registry  # heavy

    try:
        registry = load_registry()
    except ModelError as exc:
        return fail(str(exc))
    defaults = {registry.default_chat_model: "chat", registry.default_embedding_model: "embedding"}
    print(f"model cache: {get_settings().model_cache}")
    rows = [("NAME", "TASK", "STATUS", "DEFAULT", "CHECKPOINT")]
    for name, spec in registry.models.items():
        status = model_status(name, spec)
        rows.append((name, spec.task, status, defaults.get(name, ""), spec.checkpoint))
    for name, adapter in registry.adapters.items():
        rows.append((name, f"lora r{adapter.rank}", adapter_status(name, adapter), f"on {adapter.base}",
                     adapter.checkpoint))
    print_table(rows)
    return 0


def prepare_models(args: argparse.Namespace) -> int:
    from llm_batch.core.model_config import ModelError  # heavy
    from llm_batch.infra.adapters import prepare_adapter  # heavy
    from llm_batch.infra.model_cache import prepare_model  # heavy
    from llm_batch.infra.model_registry import load_registry  # heavy

    try:
        registry = load_registry()
        names = args.names or registry.default_models
        for name in names:
            registry.get(name)  # every name is checked before anything is built
        for name in names:
            started = time.monotonic()
            if name in registry.adapters:
                path = prepare_adapter(name, force=args.force, registry=registry)
            else:
                path = prepare_model(name, force=args.force, registry=registry)
            print(f"{name}: ready at {path} ({time.monotonic() - started:.1f} s)")
    except ModelError as exc:
        return fail(str(exc))
    return 0
