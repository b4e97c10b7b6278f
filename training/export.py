"""Consolidate a ZeRO-3 checkpoint into one HF-Llama-compatible safetensors model, and load it back.

Export reads the checkpoint's fp32 master partitions offline (zero_to_fp32), so it needs no
process group and no more memory than one full fp32 copy of the model.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from training.model import KilnLM, ModelConfig

EMBED = "model.embed_tokens.weight"
HF_TOKENIZER_DIR = "hf"  # the tokenizer asset's Hugging Face tokenizer (engine/tokenizer.py)
LM_HEAD = "lm_head.weight"


def hf_config(cfg: ModelConfig) -> dict:
    """`config.json` for transformers' LlamaForCausalLM."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": cfg.bos_id,
        "eos_token_id": cfg.eos_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def model_config_from_hf(hf: dict) -> ModelConfig:
    if hf.get("model_type") != "llama":
        raise ValueError(f"expected a llama config, got model_type={hf.get('model_type')!r}")
    if hf.get("rope_scaling"):
        raise ValueError("rope_scaling is not implemented in Kiln's model")
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        hidden_dim=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        rope_theta=hf.get("rope_theta", 10000.0),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.02),
        bos_id=hf.get("bos_token_id"),
        eos_id=hf.get("eos_token_id"),
    )
    if hf.get("head_dim", cfg.head_dim) != cfg.head_dim:
        raise ValueError(f"head_dim {hf['head_dim']} != hidden_size / heads = {cfg.head_dim}")
    return cfg


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every state_dict entry the model has (both names of a tied weight), built without memory."""
    with torch.device("meta"):
        model = KilnLM(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _checked_export_tensors(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors to write, validated: all names present, exact shapes, nothing empty.

    ZeRO-3 once exported tied weights as empty tensors (DeepSpeed #1896), which loads without
    complaint into some code paths; shape equality with the model's own state_dict catches that.
    """
    shapes = expected_shapes(cfg)
    if cfg.tie_embeddings and LM_HEAD not in state_dict and EMBED in state_dict:
        state_dict = {**state_dict, LM_HEAD: state_dict[EMBED]}
    missing = sorted(set(shapes) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
    for name, shape in shapes.items():
        got = tuple(state_dict[name].shape)
        if got != shape or state_dict[name].numel() == 0:
            raise ValueError(f"{name}: exported shape {got}, model expects {shape}")
    if cfg.tie_embeddings and not torch.equal(state_dict[LM_HEAD], state_dict[EMBED]):
        raise ValueError("tied lm_head.weight differs from the embedding")
    # HF writes tied models without lm_head (it re-ties on load); safetensors refuses shared storage.
    names = [n for n in shapes if not (cfg.tie_embeddings and n == LM_HEAD)]
    return {n: state_dict[n].detach().to(torch.float32).contiguous().clone() for n in names}


def copy_tokenizer(tokenizer_dir: str | Path, export_dir: str | Path) -> list[str]:
    """The tokenizer folder's `tokenizer.model` and, when it has one, its Hugging Face tokenizer
    (`hf/`: tokenizer.json, tokenizer_config.json, special_tokens_map.json) into export_dir, so
    `AutoTokenizer.from_pretrained(export_dir)` encodes exactly like SentencePiece. Returns the names."""
    tokenizer_dir, export_dir = Path(tokenizer_dir), Path(export_dir)
    source = tokenizer_dir / "tokenizer.model"
    if not source.exists():
        raise FileNotFoundError(f"no tokenizer.model in {tokenizer_dir}")
    copied = {"tokenizer.model": source}
    hf_dir = tokenizer_dir / HF_TOKENIZER_DIR
    if hf_dir.is_dir():
        for path in sorted(hf_dir.iterdir()):
            if path.name == "config.json":  # the model's config.json is ours; never let a tokenizer file replace it
                continue
            if path.is_file():
                copied[path.name] = path
    for name, path in copied.items():
        shutil.copyfile(path, export_dir / name)
    return sorted(copied)


def save_export(state_dict: dict[str, torch.Tensor], cfg: ModelConfig, export_dir: str | Path,
                tokenizer_dir: str | Path | None = None, filename: str = "model.safetensors",
                metadata: dict | None = None) -> Path:
    """Write `filename`, config.json, the tokenizer (copy_tokenizer) and export_meta.json (`metadata`)
    into export_dir; returns the weights path."""
    export_dir = Path(export_dir)
    export_dir.mkdir(parents=True, exist_ok=True)
    tensors = _checked_export_tensors(state_dict, cfg)
    path = export_dir / filename
    # "format": "pt" is what transformers checks before loading a safetensors file. Provenance goes
    # to a sorted JSON sidecar: safetensors stores its metadata map in random order, which would
    # make identical weights differ byte for byte between runs.
    save_file(tensors, str(path), metadata={"format": "pt"})
    if metadata:
        (export_dir / "export_meta.json").write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
    (export_dir / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, export_dir)
    return path


def export_checkpoint(ckpt_dir: str | Path, export_dir: str | Path, cfg: ModelConfig,
                      tag: str | None = None, tokenizer_dir: str | Path | None = None,
                      metadata: dict | None = None) -> Path:
    """Consolidate ZeRO shards of `ckpt_dir/<tag>` (default: the `latest` tag) into export_dir."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from training.checkpointing import weights_only_loads

    with weights_only_loads():
        state_dict = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    return save_export(state_dict, cfg, export_dir, tokenizer_dir, metadata=metadata)


def load_exported(export_dir: str | Path, filename: str = "model.safetensors") -> tuple[KilnLM, ModelConfig]:
    """Kiln's model from an export folder (safetensors only: no pickle is ever unpickled)."""
    export_dir = Path(export_dir)
    cfg = model_config_from_hf(json.loads((export_dir / "config.json").read_text()))
    state_dict = load_file(str(export_dir / filename))
    if cfg.tie_embeddings:
        state_dict.setdefault(LM_HEAD, state_dict[EMBED])
    model = KilnLM(cfg)
    model.load_state_dict(state_dict, strict=True)
    if cfg.tie_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.eval(), cfg


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export a Kiln ZeRO-3 checkpoint to safetensors")
    parser.add_argument("--out-dir", required=True, help="training out_dir (holds model_config.json and ckpt/)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    parser.add_argument("--export-dir", default=None, help="default: <out-dir>/export")
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir)
    model_cfg = ModelConfig.from_dict(json.loads((out_dir / "model_config.json").read_text()))
    run = json.loads((out_dir / "resolved_config.json").read_text())
    path = export_checkpoint(out_dir / "ckpt", args.export_dir or out_dir / "export", model_cfg,
                             tag=args.tag, tokenizer_dir=run.get("tokenizer_dir"))
    print(path)


if __name__ == "__main__":
    main()
