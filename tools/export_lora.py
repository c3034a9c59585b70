"""Export a LoRA run's adapter: a merged Hugging Face checkpoint and a PEFT-layout adapter directory.

    python3 -m tools.export_lora RUN_DIR/checkpoints/step_000040/model --merged OUT_MODEL --adapter OUT_ADAPTER

The source is a LoRA trainer checkpoint (it names its base model in lora_base.json) or any adapter directory we
wrote, with ``--base`` naming the base when the directory does not. ``--merged`` writes the base with the adapter
merged into its weights (config, safetensors, tokenizer files: loads in ``transformers`` and here);
``--adapter`` writes ``adapter_config.json`` + ``adapter_model.safetensors``, which
``peft.PeftModel.from_pretrained(base, OUT_ADAPTER)`` loads on the base model.
"""
from __future__ import annotations

import argparse
import sys

from actors.engines.checkpoint import (CheckpointError, load_config, load_merged, read_tokenizer_files, save_model,
                                       write_tokenizer_files)
from actors.engines.lora import LoraError, adapter_problem, read_adapter, resolve_start, write_adapter


def export(source: str, merged: str | None, adapter: str | None, base: str | None = None) -> list[str]:
    """Write what is asked; the lines to print."""
    base_dir = base or resolve_start(source)[0]
    problem = adapter_problem(source, load_config(base_dir))
    if problem:
        raise CheckpointError(problem)
    spec, tensors, _ = read_adapter(source)
    lines = []
    if merged:
        save_model(load_merged(source, base_dir=base_dir), merged)
        write_tokenizer_files(read_tokenizer_files(base_dir), merged)
        lines.append(f"merged checkpoint: {merged} (base {base_dir} + adapter rank {spec.rank})")
    if adapter:
        write_adapter(adapter, tensors, spec, base_dir, load_config(base_dir))
        lines.append(f"PEFT adapter: {adapter} ({len(tensors)} tensors; peft.PeftModel.from_pretrained(base, '{adapter}'))")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.export_lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a LoRA checkpoint directory (RUN_DIR/checkpoints/step_N/model) or adapter directory")
    parser.add_argument("--merged", help="write the merged Hugging Face checkpoint here")
    parser.add_argument("--adapter", help="write the PEFT-layout adapter directory here")
    parser.add_argument("--base", help="the base model directory (default: the one the source names)")
    args = parser.parse_args(argv)
    if not args.merged and not args.adapter:
        parser.error("nothing to write: give --merged, --adapter or both")
    try:
        for line in export(args.source, args.merged, args.adapter, args.base):
            print(line)
    except (CheckpointError, LoraError, OSError) as exc:
        print(f"export_lora: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
