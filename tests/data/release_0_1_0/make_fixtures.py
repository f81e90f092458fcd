"""Tiny saved folders of every lazoo model type with their logits, written by the code at HEAD."""
import json, sys, os, shutil
from pathlib import Path
import torch
sys.path.insert(0, "/work/main/tests")
os.environ["HF_HUB_OFFLINE"] = "1"
import lazoo
from conftest import tiny_config, perturb_
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
ids = torch.tensor([[5, 17, 3, 88, 41, 9, 62, 30, 7, 14, 99, 2, 56, 71, 23, 4, 38, 90, 11, 65]])
small = dict(hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=101)
expected = {}
def save(name, model):
    d = out / name
    model.save_pretrained(d)
    for f in d.iterdir():
        if f.suffix == ".py" or f.name == "README.md": f.unlink()
    cfg = json.loads((d / "config.json").read_text()); cfg.pop("auto_map", None)
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    with torch.no_grad():
        expected[name] = model(ids).logits.double()
for mech in lazoo.list_mechanisms() + ["hybrid"]:
    torch.manual_seed(0)
    model = perturb_(AutoModelForCausalLM.from_config(tiny_config(mech, **small)), seed=1).eval()
    save(mech, model)
torch.manual_seed(0)
cls = perturb_(AutoModelForSequenceClassification.from_config(tiny_config("ela", **small, num_labels=3, bidirectional=True)), seed=1).eval()
save("ela_seqcls_bidirectional", cls)
torch.manual_seed(0)
cfg = tiny_config("hybrid", **small); cfg.layer_types = ["sliding_window", "ovq"]
cfg.mixer_kwargs = {"ovq": {"chunk_size": 4, "max_dict_size": 12}}
save("hybrid_sw_ovq", perturb_(AutoModelForCausalLM.from_config(cfg), seed=1).eval())
torch.save({"input_ids": ids, "logits": expected}, out / "expected_logits.pt")
print(sorted(expected))
