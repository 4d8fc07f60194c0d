#!/usr/bin/env python3
"""NVFP4 test checkpoints from the bf16 fixtures, as NVIDIA ModelOpt exports them, and their
Hugging Face float64 references.

Two steps, so that the checkpoints can be made on any machine (numpy only) and the references
where torch, transformers and peft are installed:

  make_nvfp4_fixtures.py quantize   FIXTURES [--arch A]   # writes FIXTURES/<arch>/model-nvfp4
  make_nvfp4_fixtures.py references FIXTURES [--arch A]   # writes expected-nvfp4 + cases.json entry

Quantisation follows ModelOpt's NVFP4QTensor (modelopt/torch/quantization/qtensor/nvfp4_tensor.py),
all in float32 as torch computes it:
  weight_scale_2 = amax(W) / (6 * 448)                       (per tensor; shared by modules that
                                                              read the same input: q/k/v, gate/up)
  weight_scale   = e4m3(amax(16-value group) / (6 * weight_scale_2)), 0 -> 1
  q              = e2m1(W / (weight_scale * weight_scale_2))  round to nearest even, saturating at 6
  packed byte j  = q[2j] | q[2j + 1] << 4                     (low nibble first)
The references run the model whose weights are the dequantised values, computed in f32 exactly as
the engine's CPU reference does: (e2m1 * scale) * weight_scale_2.
"""
import argparse
import json
import os
import shutil
import struct
import sys

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
GROUP = 16

# Per architecture: which modules stay unquantised (ModelOpt's exclude list, glob patterns) and
# how the quantisation is declared (config.json's quantization_config, hf_quant_config.json or both),
# so that the fixtures cover every form the loader reads.
PLANS = {
    "qwen3moe": dict(exclude=["lm_head", "model.layers.*.mlp.gate"], config_json=True, hf_quant=True),
    # Attention kept in bf16, as DeepSeek-R1-FP4 does: checkpoints mix NVFP4 and dense projections.
    "mixtral": dict(exclude=["lm_head", "model.layers.*.block_sparse_moe.gate", "model.layers.*.self_attn*"],
                    config_json=False, hf_quant=True),
    "deepseekv3": dict(exclude=["lm_head", "model.layers.*.mlp.gate"], config_json=True, hf_quant=False),
}
# Modules that read the same input share one weight_scale_2 (ModelOpt's linear fusion pre-processing).
FUSED = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3")]


# ---- safetensors (the format is a JSON header and raw little-endian data)
ST_DTYPES = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "U8": np.uint8, "F8_E4M3": np.uint8,
             "BF16": np.uint16}


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a = np.frombuffer(raw[base + e["data_offsets"][0]:base + e["data_offsets"][1]], dtype=ST_DTYPES[e["dtype"]])
        a = a.reshape(e["shape"])
        if e["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = (e["dtype"], a)
    return out


def write_safetensors(path, tensors):
    """tensors: name -> (dtype name, numpy array already in that layout; BF16 as uint16 bits)."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        dt, a = tensors[name]
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


# ---- number formats
def e4m3_values():
    """f32 values of the e4m3fn codes 0..126 (positive, finite), increasing with the code."""
    v = []
    for c in range(127):
        e, m = c >> 3, c & 7
        v.append((m / 8.0) * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.array(v, dtype=np.float64)


E4M3 = e4m3_values()


def to_e4m3(x):
    """Round non-negative f32 values to e4m3fn codes: nearest, ties to the even code, saturating."""
    x = np.asarray(x, dtype=np.float64)
    hi = np.clip(np.searchsorted(E4M3, x), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    d_hi, d_lo = np.abs(E4M3[hi] - x), np.abs(x - E4M3[lo])
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0))
    return np.where(pick_lo, lo, hi).astype(np.uint8)


def to_e2m1(x):
    """ModelOpt's _cast_fp4: |x| against the midpoints, ties to even, saturating at 6; sign bit 8."""
    x = np.asarray(x, dtype=np.float32)
    bounds = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    a = np.abs(x)
    code = np.searchsorted(bounds, a, side="left").astype(np.uint8)
    code = code + np.isin(a, bounds[[1, 3, 5]]).astype(np.uint8)  # 0.75, 1.75, 3.5 round up to even
    return code | ((x < 0).astype(np.uint8) << 3)


def quantize(w, global_amax):
    """w: f32 [out, in]; global_amax: the amax the tensor's weight_scale_2 comes from."""
    out_f, in_f = w.shape
    assert in_f % GROUP == 0, (w.shape, "NVFP4 needs whole groups of 16")
    g = np.float32(global_amax) / np.float32(6.0 * 448.0)
    groups = w.reshape(out_f, in_f // GROUP, GROUP)
    block_amax = np.abs(groups).max(axis=-1).astype(np.float32)
    scale = (block_amax / (np.float32(6.0) * g)).astype(np.float32)
    scale[scale == 0] = np.float32(1.0)
    s8 = to_e4m3(scale)
    s_f32 = E4M3[s8].astype(np.float32)
    scaled = (groups / (s_f32 * g)[..., None]).astype(np.float32).reshape(out_f, in_f)
    q = to_e2m1(scaled)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return packed, s8, g


def dequantize(packed, s8, g):
    """As the engine's CPU reference: (e2m1 * e4m3 scale) in f32, then times the global scale."""
    out_f = packed.shape[0]
    q = np.empty((out_f, packed.shape[1] * 2), dtype=np.uint8)
    q[:, 0::2], q[:, 1::2] = packed & 15, packed >> 4
    v = E2M1[q & 7] * np.where(q & 8, np.float32(-1), np.float32(1))
    s = np.repeat(E4M3[s8].astype(np.float32), GROUP, axis=1)
    return ((v * s).astype(np.float32) * np.float32(g)).astype(np.float32)


def glob_match(pattern, text):
    import fnmatch
    return fnmatch.fnmatchcase(text, pattern)


def excluded(module, patterns):
    parts = module.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(glob_match(p, m) for p in patterns for m in prefixes)


def is_linear(name, a):
    return name.endswith(".weight") and a.ndim == 2 and ".layers." in name and "norm" not in name


def fused_partner_amax(name, tensors):
    """amax over the modules that share this one's input (q/k/v, gate/up of one MLP or expert)."""
    module = name[: -len(".weight")]
    stem, _, leaf = module.rpartition(".")
    for group in FUSED:
        if leaf in group:
            names = [f"{stem}.{m}.weight" for m in group if f"{stem}.{m}.weight" in tensors]
            return max(float(np.abs(tensors[n][1]).max()) for n in names)
    return float(np.abs(tensors[name][1]).max())


def quantize_arch(root, arch):
    plan = PLANS[arch]
    src, dst = os.path.join(root, "model-bf16"), os.path.join(root, "model-nvfp4")
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    tensors = read_safetensors(os.path.join(src, "model.safetensors"))
    out, n_q = {}, 0
    for name, (dt, a) in tensors.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        if is_linear(name, a) and not excluded(module, plan["exclude"]):
            packed, s8, g = quantize(a.astype(np.float32), fused_partner_amax(name, tensors))
            out[name] = ("U8", packed)
            out[module + ".weight_scale"] = ("F8_E4M3", s8)
            out[module + ".weight_scale_2"] = ("F32", np.array(g, dtype=np.float32).reshape(()))
            # A static activation scale, as ModelOpt writes after calibration; the engine keeps
            # activations in its compute dtype and does not read it.
            out[module + ".input_scale"] = ("F32", np.array(1.0 / 448.0, dtype=np.float32).reshape(()))
            n_q += 1
        else:
            bits = (a.view(np.uint32) >> 16).astype(np.uint16) if dt == "BF16" else a
            out[name] = (dt, bits)
    write_safetensors(os.path.join(dst, "model.safetensors"), out)
    cfg = json.load(open(os.path.join(src, "config.json")))
    if plan["config_json"]:
        cfg["quantization_config"] = {
            "quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_scheme": None,
            "producer": {"name": "modelopt"}, "ignore": plan["exclude"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "float", "group_size": GROUP, "dynamic": False}}}}
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2)
    if plan["hf_quant"]:
        hq = {"producer": {"name": "modelopt", "version": "fixture"},
              "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": GROUP,
                               "exclude_modules": plan["exclude"]}}
        json.dump(hq, open(os.path.join(dst, "hf_quant_config.json"), "w"), indent=2)
    for f in ("generation_config.json",):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)
    print(f"{arch}: {n_q} linear weights in NVFP4 -> {dst}", flush=True)


def dequantized_checkpoint(root, out_dir):
    """The NVFP4 model with every weight dequantised to f32 (what the references run)."""
    src = os.path.join(root, "model-nvfp4")
    tensors = read_safetensors(os.path.join(src, "model.safetensors"))
    out = {}
    for name, (dt, a) in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        if dt == "U8":
            m = name[: -len(".weight")]
            out[name] = ("F32", dequantize(a, tensors[m + ".weight_scale"][1],
                                           float(tensors[m + ".weight_scale_2"][1])))
        else:
            out[name] = ("F32", a.astype(np.float32))
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), out)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg.pop("quantization_config", None)
    cfg["dtype"] = cfg["torch_dtype"] = "float32"
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"), indent=2)
    if os.path.exists(os.path.join(src, "generation_config.json")):
        shutil.copy(os.path.join(src, "generation_config.json"), out_dir)


def references_arch(root, arch):
    import torch
    from peft import PeftModel
    import transformers
    from safetensors.torch import save_file

    cases_path = os.path.join(root, "cases.json")
    entry = json.load(open(cases_path))
    deq = os.path.join(root, ".model-nvfp4-dequantized")
    dequantized_checkpoint(root, deq)
    cls = getattr(transformers, json.load(open(os.path.join(deq, "config.json")))["architectures"][0])
    try:
        base = cls.from_pretrained(deq, dtype=torch.float64, experts_implementation="eager")
    except TypeError:
        base = cls.from_pretrained(deq, dtype=torch.float64)
        base.config._experts_implementation = "eager"
    base.eval()
    names = entry["adapters"]
    pm = None
    for name in names:
        path = os.path.join(root, "adapters", name)
        if pm is None:
            pm = PeftModel.from_pretrained(base, path, adapter_name=name)
        else:
            pm.load_adapter(path, adapter_name=name)
    pm.eval()
    # The same prompts and adapters as the bf16 and FP8 cases of this model.
    cases, tensors = [], {}
    for c in entry["checkpoints"]["bf16"]["cases"]:
        ids = torch.tensor([c["prompt_ids"]])
        a, n = c["adapter"], c["new_tokens"]
        with torch.no_grad():
            if a is None:
                ctx = pm.disable_adapter()
            else:
                pm.set_adapter(a)
                ctx = torch.no_grad()
            with ctx:
                logits = pm(input_ids=ids).logits[0].float()
                out = pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=0)
        key = c["id"]
        tensors[key + ".prefill_logits"] = logits.contiguous()
        tensors[key + ".gen_ids"] = out.sequences[0, ids.shape[1]:].to(torch.int64).contiguous()
        tensors[key + ".gen_logits"] = torch.stack([l[0] for l in out.logits]).float().contiguous()
        cases.append(dict(c))
    save_file(tensors, os.path.join(root, "expected-nvfp4.safetensors"))
    entry["checkpoints"]["nvfp4"] = {"model_dir": "model-nvfp4", "expected": "expected-nvfp4.safetensors",
                                     "cases": cases}
    json.dump(entry, open(cases_path, "w"), indent=1)
    shutil.rmtree(deq, ignore_errors=True)
    print(f"{arch}: {len(cases)} NVFP4 reference cases (transformers {transformers.__version__})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["quantize", "references"])
    ap.add_argument("fixtures")
    ap.add_argument("--arch", default=None)
    args = ap.parse_args()
    for arch in PLANS:
        if args.arch and arch != args.arch:
            continue
        root = os.path.join(args.fixtures, arch)
        if not os.path.isdir(root):
            print(f"skip {arch}: no {root}", file=sys.stderr)
            continue
        (quantize_arch if args.step == "quantize" else references_arch)(root, arch)


if __name__ == "__main__":
    main()
