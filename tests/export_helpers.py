"""Running a script in a fresh interpreter, for the `trust_remote_code` export tests: lazoo made unimportable, with
only the environment transformers needs offline; the script that loads saved language-model folders there and
generates (`run_loader`), and `push_to_hub` stubbed offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

#: the opening of every script: lazoo cannot be imported
HIDE_LAZOO = textwrap.dedent('''
    import importlib.abc
    import json, sys

    class HideLazoo(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "lazoo" or name.startswith("lazoo."):
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
            return None

    sys.meta_path.insert(0, HideLazoo())
    try:
        import lazoo  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("lazoo is still importable")
''')

#: the end of every script: which lazoo modules were imported, the transformers version, the results as JSON
REPORT = textwrap.dedent('''
    results["lazoo_imported"] = sorted(m for m in sys.modules if m == "lazoo" or m.startswith("lazoo."))
    import transformers
    results["transformers"] = transformers.__version__
    print("RESULT" + json.dumps(results))
''')

#: another virtualenv's python (scripts/test_range.sh sets it to the other end of the supported range)
OTHER_PYTHON = os.environ.get("LAZOO_OTHER_PYTHON")


def run_script(body: str, args: list[str], tmp_path, python: str = sys.executable) -> dict:
    """Run `HIDE_LAZOO + body + REPORT` (`body` fills the dict `results`) as `python -c SCRIPT *args` in
    `tmp_path`, offline, with its own transformers module cache; returns `results`."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "hf_modules"), PYTHONNOUSERSITE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    script = HIDE_LAZOO + textwrap.dedent(body) + REPORT
    proc = subprocess.run([python, "-c", script, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


PROMPT = [[5, 17, 42, 8, 99, 23, 4], [0, 0, 0, 61, 7, 30, 12]]  # the second row left-padded
NEW_TOKENS = 8

#: a text for the tokenizers saved next to some of the models
TEXT = "In the beginning God created the heaven and the earth. And the earth was without form, and void."

# Runs in a fresh interpreter: loads every folder with trust_remote_code and generates greedily; loads a tokenizer
# saved in the folder with AutoTokenizer (trust_remote_code) and with its own class (no flag needed).
# argv: prompt, text, folders... (MAX_NEW_TOKENS stands for NEW_TOKENS)
LOADER = '''
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    torch.set_num_threads(1)
    prompt = torch.tensor(json.loads(sys.argv[1]))
    text = sys.argv[2]
    mask = (prompt != 0).long()
    results = {}
    for folder in sys.argv[3:]:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        with torch.no_grad():
            logits = model(prompt, attention_mask=mask).logits
            tokens = model.generate(prompt, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        results[folder] = {"module": type(model).__module__, "config_module": type(model.config).__module__,
                           "tokens": tokens.tolist(), "logits": logits.tolist()}
        if os.path.isfile(os.path.join(folder, "tokenizer.json")):
            tokenizers = {"auto": AutoTokenizer.from_pretrained(folder, trust_remote_code=True),
                          "own_class": PreTrainedTokenizerFast.from_pretrained(folder)}
            results[folder]["tokenizer"] = {
                name: {"ids": tok(text).input_ids, "decoded": tok.decode(tok(text).input_ids),
                       "special": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id], "side": tok.padding_side}
                for name, tok in tokenizers.items()}
        if folder == sys.argv[3]:  # re-save the loaded model, load that again
            model.save_pretrained(folder + "-resaved")
            again = AutoModelForCausalLM.from_pretrained(folder + "-resaved", trust_remote_code=True).eval()
            with torch.no_grad():
                results[folder]["resaved_tokens"] = again.generate(
                    prompt, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False).tolist()
'''.replace("MAX_NEW_TOKENS", str(NEW_TOKENS))


def run_loader(folders: list[str], tmp_path, python: str = sys.executable) -> dict:
    return run_script(LOADER, [json.dumps(PROMPT), TEXT, *folders], tmp_path, python=python)


def stub_push_to_hub(monkeypatch) -> dict:
    """The Hub calls of `push_to_hub` stubbed (offline): returns a dict that receives the uploaded file names
    (`files`) and the README.md text (`card`). A new repo gets transformers' generic card first, as on the Hub."""
    import transformers.utils.hub as hub
    from huggingface_hub import ModelCard, ModelCardData

    uploaded = {}

    class Api:
        def create_repo(self, repo_id, **kwargs):
            return type("Repo", (), {"repo_id": repo_id})()

    def fake_upload(self, working_dir, repo_id, **kwargs):
        uploaded["files"] = sorted(os.listdir(working_dir))
        uploaded["card"] = open(os.path.join(working_dir, "README.md"), encoding="utf-8").read()

    generic = ModelCard.from_template(ModelCardData(), model_description="This is the model card of a 🤗 "
                                      "transformers model that has been pushed on the Hub. (stub)")
    monkeypatch.setattr(hub, "hf_api", lambda: Api())
    monkeypatch.setattr(hub, "create_and_tag_model_card", lambda *a, **kw: generic)
    monkeypatch.setattr(hub.PushToHubMixin, "_upload_modified_files", fake_upload)
    return uploaded
