"""``draftheads bench --peers openvino`` (draftheads/bench/peer_openvino.py and its runner
script, openvino_runner.py): OpenVINO GenAI in a venv of its own, made on first use, as two
columns of the bs-1 bench. No OpenVINO and no network here: the venv's steps are stood in for,
and the real runner script runs on this Python against stand-in ``openvino`` /
``openvino_genai`` modules that decode by a rule the tests can check."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from draftheads.bench import peer_openvino as ov
from draftheads.bench import peers
from draftheads.core.errors import DraftheadsError, InputError

#: stand-ins for the two packages the runner imports: the pipeline's new tokens are the last
#: prompt id + 1, + 2, ... up to the first stop token (kept); a lookup pipeline wants a lookup
#: config and the reverse; max_new_tokens 999 sleeps (a hung engine)
FAKE_OPENVINO = '''
def get_version():
    return "fake-ov"

class Type:
    def __init__(self, name):
        self.name = name
    def get_type_name(self):
        return self.name

class Tensor:
    def __init__(self, array):
        self.data = array

class Core:
    def get_property(self, device, key):
        return ["BF16", "FP32"]
    def compile_model(self, path, device, props):
        return Compiled(props)

class Compiled:
    def __init__(self, props):
        self.props = props
    def get_property(self, key):
        value = self.props.get(key, "default")
        return Type(value) if key.endswith("PRECISION_HINT") or key == "KV_CACHE_PRECISION" else value
'''
FAKE_GENAI = '''
import time
__version__ = "fake-genai"

class GenerationConfig:
    num_assistant_tokens = 0
    max_ngram_size = 0
    def set_eos_token_id(self, token):
        self.eos_token_id = token

class Metric:
    mean = 5.0

class Metrics:
    def get_ttft(self):
        return Metric()

class Result:
    def __init__(self, tokens):
        self.tokens = [tokens]
        self.perf_metrics = Metrics()

class LLMPipeline:
    def __init__(self, model, device, prompt_lookup=False, **props):
        self.lookup, self.props = prompt_lookup, props
    def generate(self, ids, cfg):
        if self.lookup != (cfg.num_assistant_tokens == 10 and cfg.max_ngram_size == 2):
            raise ValueError("prompt lookup asked of the wrong pipeline")
        assert cfg.do_sample is False and self.props["INFERENCE_NUM_THREADS"] >= 1
        time.sleep(30 if cfg.max_new_tokens == 999 else 0.002)
        last, new = int(ids.data[0, -1]), []
        for i in range(cfg.max_new_tokens):
            new.append((last + 1 + i) % 90 + 3)
            if new[-1] in cfg.stop_token_ids:
                break
        return Result(new)
'''


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    """The venv's Python is this one, the exported model a folder here, the packages stand-ins."""
    modules = tmp_path / "fake_modules"
    for name, text in (("openvino", FAKE_OPENVINO), ("openvino_genai", FAKE_GENAI)):
        (modules / name).mkdir(parents=True)
        (modules / name / "__init__.py").write_text(textwrap.dedent(text))
    env = {k: v for k, v in ov.runner_env().items()}
    monkeypatch.setattr(ov, "runner_env", lambda: {**env, "PYTHONPATH": str(modules)})
    monkeypatch.setattr(ov, "engine_python", lambda log=print: Path(sys.executable))
    monkeypatch.setattr(ov, "exported", lambda python, folder, log=print: tmp_path / "exported")
    return modules


def stand_in_base(tmp_path: Path, dtype=torch.bfloat16):
    folder = tmp_path / "base"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    return type("Base", (), {"name_or_path": str(folder), "dtype": dtype})()


def test_openvino_is_a_peer_of_its_own_and_beside_llama_cpp():
    assert peers.parse_peers("llama.cpp, openvino") == ("llama.cpp", "openvino")
    assert peers.parse_peers("openvino") == ("openvino",)


def test_a_venv_that_cannot_be_made_is_one_line_saying_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    commands: list[list[str]] = []

    def pip_fails(command, log_file, timeout=0):
        commands.append(command)
        if "pip" in command:
            log_file.write_text(log_file.read_text() + "ERROR: No matching distribution found for openvino-genai\n")
            return 1
        (Path(command[-1]) / "bin").mkdir(parents=True)
        return 0

    monkeypatch.setattr(ov, "_run_logged", pip_fails)
    lines: list[str] = []
    assert peers.load_peers(("openvino",), stand_in_base(tmp_path), [2], log=lines.append) == {}
    venv = tmp_path / "cache" / "engines" / "openvino-venv"
    assert capsys.readouterr().out.startswith(f"peer openvino: making its venv {venv}")
    assert len(lines) == 1 and lines[0].startswith("peer openvino: not installed: its venv could not be made (pip "
                                                   "install failed: ERROR: No matching distribution found for openvino")
    assert f"to compare with it: draftheads makes {venv} on first use" in lines[0] and "\n" not in lines[0]
    assert not venv.exists()  # a half-made venv is not kept
    install = commands[1]
    assert install[-2:] == list(ov.REQUIREMENTS) and install[install.index("-c") + 1].endswith("constraints.txt")
    assert (venv.parent / "openvino-venv-constraints.txt").read_text() == f"torch=={torch.__version__}\n"


def test_a_finished_venv_is_reused_and_an_unfinished_one_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    made: list[list[str]] = []

    def steps_succeed(command, log_file, timeout=0):
        made.append(command)
        if command[1:3] == ["-m", "venv"]:
            (Path(command[-1]) / "bin").mkdir(parents=True)
            (Path(command[-1]) / "bin" / "python").write_text("")
        return 0

    monkeypatch.setattr(ov, "_run_logged", steps_succeed)
    python = ov.engine_python(log=lambda line: None)
    assert [c[1:4] for c in made] == [["-m", "venv", str(python.parents[1])], ["-m", "pip", "install"],
                                      ["-m", "pip", "uninstall"], ["-c", "import openvino_genai, optimum.intel"]]
    assert ov.engine_python(log=lambda line: None) == python and len(made) == 4  # recorded: reused
    (python.parents[1] / ov.VENV_RECORD).write_text(json.dumps({"requirements": ["openvino-genai==0.1"]}))
    assert ov.engine_python(log=lambda line: None) == python and len(made) == 8  # other pins: made again


def test_the_export_runs_once_and_a_failed_one_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    folder = Path(stand_in_base(tmp_path).name_or_path)
    calls: list[list[str]] = []

    def export(command, log_file, timeout=0):
        calls.append(command)
        out = Path(command[-1])
        out.mkdir(parents=True)
        for name in ov.MODEL_FILES:
            (out / name).write_text("x")
        return 0

    monkeypatch.setattr(ov, "_run_logged", export)
    target = ov.exported(Path("/venv/bin/python"), folder, log=lambda line: None)
    assert target.parent == tmp_path / "cache" / "engines" / "openvino" and target.name.startswith("base-")
    assert calls[0][:3] == ["/venv/bin/optimum-cli", "export", "openvino"] and "fp32" in calls[0]
    assert ov.exported(Path("/venv/bin/python"), folder, log=lambda line: None) == target and len(calls) == 1
    (folder / "model.safetensors").write_text("other weights")  # another base: another export

    def export_fails(command, log_file, timeout=0):
        log_file.write_text("ValueError: unsupported architecture\n")
        return 1

    monkeypatch.setattr(ov, "_run_logged", export_fails)
    with pytest.raises(DraftheadsError, match=r"exporting .* failed \(ValueError: unsupported architecture\); see "):
        ov.exported(Path("/venv/bin/python"), folder, log=lambda line: None)


def test_what_openvino_cannot_run_is_one_line_naming_what_to_pass(tmp_path):
    with pytest.raises(InputError, match="no OpenVINO CPU precision for torch.float64; bench in float32"):
        ov.openvino_runs(stand_in_base(tmp_path, torch.float64), [2])
    hub = type("Base", (), {"name_or_path": "HuggingFaceTB/SmolLM2-135M", "dtype": torch.float32})()
    with pytest.raises(InputError, match=r"is not a local model folder; pass --base a \.gguf"):
        ov.openvino_runs(hub, [2])


def test_the_runner_decodes_the_ids_it_is_sent_in_both_modes(tmp_path, fake_engine):
    """The real runner script on stand-in packages: two columns over one process, the prompt ids
    in, the new ids out with the EOS kept, the build naming what the plugin compiled with."""
    runs = ov.openvino_runs(stand_in_base(tmp_path), [12, 40])
    assert list(runs) == ["openvino", "openvino-lookup"]
    build = runs["openvino-lookup"].build
    assert build["compiled"]["INFERENCE_PRECISION_HINT"] == "bf16" and build["compiled"]["KV_CACHE_PRECISION"] == "bf16"
    assert build["mode"] == "lookup" and build["lookup"] == ov.LOOKUP and build["weight_format"] == "fp32"
    assert build["openvino_genai"] == "fake-genai" and runs["openvino"].build["mode"] == "greedy"
    ids = torch.tensor([[1, 5, 6]])
    for run in runs.values():
        out, seconds, first = run(ids, 4)
        assert out.tolist() == [[1, 5, 6, 10, 11, 12]] and seconds > 0 and first == pytest.approx(0.005)
        assert run(torch.tensor([[1, 20]]), 3)[0].tolist() == [[1, 20, 24, 25, 26]]


def test_a_runner_that_fails_hangs_or_dies_is_one_line(tmp_path, fake_engine):
    runner = ov.Runner([sys.executable, str(ov.RUNNER)])
    runner.call({"model": str(tmp_path), "properties": {"INFERENCE_NUM_THREADS": 1}, "eos": [2], "lookup": ov.LOOKUP})
    with pytest.raises(DraftheadsError, match=r"the runner failed \(KeyError: 'beam'\); run without --peers openvino"):
        runner.call({"mode": "beam", "ids": [1], "max_new_tokens": 2})
    with pytest.raises(DraftheadsError, match="the runner gave no answer in 1 s"):
        runner.call({"mode": "greedy", "ids": [1], "max_new_tokens": 999}, timeout=1)
    assert runner.process.poll() is not None  # a hung runner is ended
    talk = "import json; input(); print('oneDNN warning'); print(json.dumps({'build': {}}))"
    chatty = ov.Runner([sys.executable, "-c", talk])
    assert chatty.call({"model": "x"}) == {"build": {}} and list(chatty.errors) == ["oneDNN warning\n"]
    dead = ov.Runner([sys.executable, "-c", "import sys; sys.stderr.write('Illegal instruction\\n'); sys.exit(3)"])
    with pytest.raises(DraftheadsError, match=r"the runner stopped \(Illegal instruction\)"):
        dead.call({"model": "x"})


def test_openvino_columns_in_the_bench_json(tmp_path, monkeypatch, capsys, fake_engine):
    """The real bench on a tiny float32 base with the stand-in engine: both columns in every
    row and in the summary, their builds in the meta; the table lists them."""
    from helpers import tiny_peer_bench

    results = tiny_peer_bench(tmp_path, monkeypatch, "openvino", "float32", 6)
    keys = {"new_tokens", "seconds", "tokens_per_second", "speedup", "first_token_seconds", "same_as_hf",
            "first_difference"}
    for row in results["per_prompt"]:
        assert set(row["peers"]) == {"openvino", "openvino-lookup"}
        assert all(set(column) == keys for column in row["peers"].values())
    assert set(results["overall"]["peers"]) == {"openvino", "openvino-lookup"}
    assert "'openvino-lookup': {" in results["meta"]["peer_builds"] and "'INFERENCE_PRECISION_HINT': 'f32'" in \
        results["meta"]["peer_builds"]
    table = capsys.readouterr().out
    assert "| openvino |" in table and "| openvino-lookup |" in table
