"""Config layers, --check, the compile guard, shipped profiles and bad input."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from trainer.cli import main
from trainer.config import COMPILE_MODES, RUNS_DIR, ConfigError, load_config

from .conftest import run_trainer

pytestmark = pytest.mark.unit  # quick: no playbook run, no training run (./dev.sh fast)
PROFILES = sorted(p.stem for p in RUNS_DIR.glob("*.yml"))


def test_profiles_exist():
    assert {"nographs", "eager"} <= set(PROFILES)


@pytest.fixture(scope="module")
def sized_target(tmp_path_factory) -> tuple[Path, Path]:
    """A target of the real layout at a CPU's size, and a synthetic chat set in its vocabulary."""
    from trainer.data.embedded import build_sized

    return build_sized(tmp_path_factory.mktemp("sized"), "qwen3-tiny", 64, "cpu", log=lambda _: None)


@pytest.mark.parametrize("run", PROFILES)
def test_every_shipped_profile_passes_check(run, tmp_path, sized_target):
    machine = []
    if load_config(run, sets=["model.target_path=x", "data.train_file=x"]).run.requires_target:
        target, data = sized_target
        machine = ["--set", f"model.target_path={target}", "--set", f"data.train_file={data}"]
    result = run_trainer(
        "--run",
        run,
        "--check",
        "--out",
        str(tmp_path / "out"),
        "--set",
        f"data.cache_dir={tmp_path / 'cache'}",
        *machine,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ok: {run}"
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("run", PROFILES)
def test_profile_holds_experiment_settings_only(run):
    data = yaml.safe_load((RUNS_DIR / f"{run}.yml").read_text())
    assert set(data) <= {"run", "compile", "train", "drafter", "data", "model"}
    # Of data and model, only the recipe's answers and dtype: the data and the target are the machine's.
    assert set(data.get("data", {})) <= {"regen_max_new_tokens"}
    assert set(data.get("model", {})) <= {"dtype"}
    assert data["run"]["topology"] in ("threaded", "process")
    assert data["run"]["description"]


def test_recipe_profile_is_the_published_dflash_recipe_for_an_8b_target():
    cfg = load_config("qwen3-8b", sets=["model.target_path=/t", "data.train_file=/d"])
    assert cfg.run.topology == "threaded" and not cfg.compile.uses_cudagraphs
    t = cfg.train
    assert (t.seq_len, t.packing, t.lr, t.warmup_frac, t.grad_clip) == (3072, True, 6e-4, 0.04, 1.0)
    d = cfg.drafter
    assert (d.num_layers, d.num_context_layers, d.block_size, d.num_anchors, d.gamma) == (5, 5, 16, 512, 7.0)
    assert cfg.train.keep_checkpoints >= 1 and cfg.train.checkpoint_every_s > 0


def test_the_recipe_regenerates_whole_answers_unless_the_machine_config_says_otherwise(tmp_path):
    """A machine config that names only the target and the data gets the recipe's cap of 2,048
    tokens, not the embedded run's 64; a machine config's own cap wins."""
    machine = tmp_path / "machine.yml"
    machine.write_text(yaml.safe_dump({"model": {"target_path": "/t"}, "data": {"train_file": "/d"}}))
    assert load_config("qwen3-8b", str(machine)).data.regen_max_new_tokens == 2048
    data = {"train_file": "/d", "regen_max_new_tokens": 512}
    machine.write_text(yaml.safe_dump({"model": {"target_path": "/t"}, "data": data}))
    assert load_config("qwen3-8b", str(machine)).data.regen_max_new_tokens == 512


def test_the_recipe_s_target_computes_in_bfloat16_unless_the_machine_config_says_otherwise(tmp_path):
    """A machine config that names only the target and the data gets bfloat16 (an 8B target in
    float32 fills an 80 GB card before its first regeneration batch); its own dtype wins."""
    machine = tmp_path / "machine.yml"
    machine.write_text(yaml.safe_dump({"model": {"target_path": "/t"}, "data": {"train_file": "/d"}}))
    assert load_config("qwen3-8b", str(machine)).model.dtype == "bfloat16"
    assert load_config("nographs", str(machine)).model.dtype == "float32"  # the embedded run's default
    machine.write_text(
        yaml.safe_dump({"model": {"target_path": "/t", "dtype": "float32"}, "data": {"train_file": "/d"}})
    )
    assert load_config("qwen3-8b", str(machine)).model.dtype == "float32"


def test_a_profile_naming_the_machine_s_target_is_refused_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr("trainer.config.RUNS_DIR", tmp_path)
    (tmp_path / "mine.yml").write_text("model: {target_path: /t, dtype: bfloat16}\n")
    with pytest.raises(ConfigError) as refused:
        load_config("mine")
    assert refused.value.problems == [
        "run profile mine: model.target_path: does not belong here (allowed of model: dtype); "
        "set it in the machine config (--config) or with --set"
    ]


def test_a_profile_setting_the_machine_s_data_is_refused_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr("trainer.config.RUNS_DIR", tmp_path)
    (tmp_path / "mine.yml").write_text("data: {train_file: /d, regen_max_new_tokens: 128}\n")
    with pytest.raises(ConfigError) as refused:
        load_config("mine")
    assert refused.value.problems == [
        "run profile mine: data.train_file: does not belong here (allowed of data: regen_max_new_tokens); "
        "set it in the machine config (--config) or with --set"
    ]


@pytest.mark.parametrize(
    ("machine", "missing"),
    [
        ([], "model.target_path and data.train_file"),
        (["model.target_path=/models/t"], "data.train_file"),
        (["data.train_file=/data/chat.jsonl"], "model.target_path"),
    ],
)
def test_recipe_without_its_target_or_data_is_refused_naming_the_keys(machine, missing, tmp_path):
    result = run_trainer(
        "--run", "qwen3-8b", "--out", str(tmp_path / "out"), "--set", f"data.cache_dir={tmp_path / 'cache'}",
        *[arg for item in machine for arg in ("--set", item)],
    )  # fmt: skip
    assert result.returncode == 2
    assert f"needs {missing} from the machine config" in result.stderr
    assert "trainer.data.embedded --shape qwen3-8b" in result.stderr, "the way out without real weights"
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists(), "nothing written"


def test_nographs_profile_is_threaded_compiled_without_cuda_graphs_logging_to_its_own_name():
    cfg = load_config("nographs")
    assert cfg.run.topology == "threaded"
    assert cfg.compile.mode == "default" and cfg.compile.dynamic is False
    assert cfg.compile.cudagraphs is False and not cfg.compile.uses_cudagraphs
    assert cfg.log_name == "train_compile_nographs.log"
    assert load_config("eager").log_name == "train_eager.log"


def _compile_sets(topology, mode, cudagraphs, trees):
    return [
        f"run.topology={topology}",
        f"compile.mode={mode}",
        f"compile.cudagraphs={cudagraphs}",
        f"compile.cudagraph_trees={trees}",
    ]


COMBOS = list(itertools.product(COMPILE_MODES, [False, True], [False, True]))


@pytest.mark.parametrize(("mode", "cudagraphs", "trees"), COMBOS)
def test_compile_guard_threaded(mode, cudagraphs, trees, tmp_path, capsys):
    graphs_on = mode != "none" and (cudagraphs or mode in ("reduce-overhead", "max-autotune"))
    code = main(
        [
            "--run",
            "nographs",
            "--check",
            "--out",
            str(tmp_path / "out"),
            *(f"--set={s}" for s in _compile_sets("threaded", mode, cudagraphs, trees)),
        ]
    )
    captured = capsys.readouterr()
    if graphs_on:
        assert code == 2
        assert "thread-local storage" in captured.err and "concurrent" in captured.err
        assert "max-autotune-no-cudagraphs" in captured.err and "run.topology=process" in captured.err
    else:
        assert code == 0, captured.err
        assert captured.out.strip() == "ok: nographs"


@pytest.mark.parametrize(("mode", "cudagraphs", "trees"), COMBOS)
def test_compile_guard_allows_everything_in_process_topology(mode, cudagraphs, trees, tmp_path, capsys):
    code = main(
        [
            "--run",
            "nographs",
            "--check",
            "--out",
            str(tmp_path / "out"),
            *(f"--set={s}" for s in _compile_sets("process", mode, cudagraphs, trees)),
        ]
    )
    assert code == 0, capsys.readouterr().err


def test_check_lists_every_problem(tmp_path, capsys):
    code = main(
        [
            "--run",
            "nographs",
            "--check",
            "--set",
            "train.lr=-1",
            "--set",
            "train.nope=3",
            "--set",
            "compile.mode=reduce-overhead",
            "--set",
            "parallel.devices=cuda:3",
            "--set",
            f"model.target_path={tmp_path / 'missing'}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert all(line.startswith("error: ") for line in err)
    joined = "\n".join(err)
    for needle in ("train.nope", "train.lr", "reduce-overhead", "cuda:3", "model.target_path"):
        assert needle in joined, joined
    assert len(err) == 5


def test_layers_later_wins(tmp_path):
    machine = tmp_path / "machine.yml"
    machine.write_text(yaml.safe_dump({"parallel": {"devices": "cpu"}, "data": {"regen_batch_size": 7}}))
    cfg = load_config("nographs", str(machine), ["data.regen_batch_size=9", "train.lr=3e-4"], steps=5, seed=3)
    assert cfg.parallel.devices == "cpu"
    assert cfg.data.regen_batch_size == 9
    assert cfg.train.lr == 3e-4 and cfg.train.steps == 5 and cfg.train.seed == 3
    assert cfg.compile.mode == "default"  # from the profile


def test_machine_config_may_not_set_experiment(tmp_path):
    machine = tmp_path / "machine.yml"
    machine.write_text(yaml.safe_dump({"compile": {"mode": "none"}}))
    with pytest.raises(ConfigError, match="does not belong"):
        load_config("nographs", str(machine))


def test_machine_example_is_valid_shape(tmp_path):
    example = RUNS_DIR.parent / "machine.example.yml"
    data = yaml.safe_load(example.read_text())
    assert set(data) == {"model", "data", "parallel"}
    # Paths in the example do not exist here; the keys and types must still load.
    data["model"]["target_path"] = ""
    data["model"]["dtype"] = "float32"
    data["data"]["train_file"] = ""
    data["parallel"]["devices"] = "cpu"
    machine = tmp_path / "machine.yml"
    machine.write_text(yaml.safe_dump(data))
    assert load_config("nographs", str(machine)).data.regen_max_new_tokens == 1024


def test_shard_optimizer_is_off_unless_asked():
    assert load_config("nographs").parallel.shard_optimizer is False
    assert load_config("nographs", sets=["parallel.shard_optimizer=true"]).parallel.shard_optimizer is True


BAD_INPUT = [
    (["--run", "nosuchrun"], "unknown run 'nosuchrun'; known runs:"),
    (["--run", "nographs", "--set", "train.nope=1"], "train.nope: unknown key"),
    (["--run", "nographs", "--set", "train.steps=many"], "train.steps: expected an integer"),
    (["--run", "nographs", "--set", "compile.dynamic=perhaps"], "compile.dynamic: expected true or false"),
    (["--run", "nographs", "--set", "model.target_path=/nonexistent/model"], "model.target_path"),
    (
        [
            "--run",
            "nographs",
            "--set",
            "model.target_path=/nonexistent/model",
            "--set",
            "data.train_file=/nonexistent/chat.jsonl",
        ],
        "model.target_path",
    ),
    (["--run", "nographs", "--set", "data.train_file=/nonexistent/chat.jsonl"], "data.train_file"),
    (["--run", "nographs", "--set", "parallel.devices=cuda:3"], "cuda:3 is not usable here"),
    (["--run", "nographs", "--set", "compile.mode=reduce-overhead"], "thread-local storage"),
    (["--run", "nographs", "--set", "parallel.bucket_mb=0"], "parallel.bucket_mb must be at least 1"),
    (
        ["--run", "nographs", "--set", "data.regen_compile_scope=model"],
        "data.regen_compile_scope must be 'auto', 'step' or 'layers', got 'model'",
    ),
    (
        ["--run", "nographs", "--set", "parallel.shard_optimizer=sometimes"],
        "parallel.shard_optimizer: expected true or false",
    ),
    (["--run", "nographs", "--config", "/nonexistent/machine.yml"], "does not exist"),
    # Non-finite and absurd numbers: each used to train on (loss nan, lr inf) or end in a traceback.
    (["--run", "nographs", "--set", "train.lr=inf"], "train.lr must be a finite number, got inf"),
    (["--run", "nographs", "--set", "train.lr=nan"], "train.lr must be a finite number, got nan"),
    (["--run", "nographs", "--set", "train.lr=5"], "train.lr must be positive and at most 1"),
    (["--run", "nographs", "--set", "train.grad_clip=-inf"], "train.grad_clip must be a finite number"),
    (["--run", "nographs", "--set", "drafter.gamma=nan"], "drafter.gamma must be a finite number"),
    (["--run", "nographs", "--steps", "99999999999999999999"], "train.steps must be at most 1000000000"),
    (["--run", "nographs", "--seed", "99999999999999999999"], "train.seed must be at most"),
    (
        ["--run", "nographs", "--set", "train.keep_checkpoints=99999999999999999999"],
        "train.keep_checkpoints must be at most 1000, got 99999999999999999999 (0 keeps every checkpoint)",
    ),
    (["--run", "nographs", "--set", "parallel.step_timeout_s=inf"], "step_timeout_s must be a finite"),
    (
        ["--run", "nographs", "--set", "parallel.rendezvous_timeout_s=99999999999"],
        "parallel.rendezvous_timeout_s must be at most 604800",
    ),
]


def test_the_eta_of_the_longest_allowed_run_is_a_line_not_an_overflow():
    from trainer.run.train import format_eta

    assert format_eta(1e15) == "999999 days, 0:00:00"  # past timedelta's range: OverflowError before
    assert format_eta(-5) == "0:00:00" and format_eta(61) == "0:01:01"


def test_a_profile_with_yaml_infinity_is_refused(tmp_path, monkeypatch):
    """YAML's `.inf` is a float like any other to the loader: the finite check catches it."""
    monkeypatch.setattr("trainer.config.RUNS_DIR", tmp_path)
    (tmp_path / "hot.yml").write_text("train: {lr: .inf, warmup_frac: .nan}\n")
    with pytest.raises(ConfigError) as refused:
        load_config("hot")
    assert refused.value.problems[:2] == [
        "train.lr must be a finite number, got inf",
        "train.warmup_frac must be a finite number, got nan",
    ]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT)
def test_bad_input_exits_2_and_writes_nothing(args, message, tmp_path, capsys):
    out, cache = tmp_path / "out", tmp_path / "cache"
    code = main([*args, "--out", str(out), "--set", f"data.cache_dir={cache}"])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert message in lines[0]
    assert not out.exists() and not cache.exists()
    assert list(tmp_path.iterdir()) == []


def test_unknown_run_lists_known_runs(capsys):
    assert main(["--run", "nosuchrun"]) == 2
    err = capsys.readouterr().err
    for run in PROFILES:
        assert run in err


def test_bad_input_through_the_real_cli(tmp_path):
    result = run_trainer(
        "--run", "nographs", "--set", "parallel.devices=cuda:3", "--out", str(tmp_path / "o")
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: parallel.devices: cuda:3 is not usable here")
    assert result.stdout == ""
    assert not Path(tmp_path / "o").exists()


def test_out_with_checkpoints_needs_resume(tmp_path, capsys):
    checkpoints = tmp_path / "out" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step_00000010.pt").write_bytes(b"x")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["--run", "eager", "--out", str(tmp_path / "out")]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_the_compiled_target_attends_causally_or_with_flex_on_cuda_for_long_rows_only_unless_told():
    cfg = load_config("nographs")
    attention = cfg.compile.target_attention_of
    assert cfg.compile.target_attention == "auto"
    assert attention("cuda", 3072, packing=True) == "flex"  # several conversations a row
    assert attention("cuda", 3072, packing=False) == "causal"  # one conversation a row
    assert attention("cuda", 128, packing=True) == "flex"
    assert attention("cuda", 96, packing=True) == "sdpa"  # the embedded model's rows on a GPU
    assert attention("cuda", 96, packing=False) == "sdpa"
    assert attention("cpu", 3072, packing=False) == "sdpa"  # not compiled there
    off = load_config("nographs", sets=["compile.target=off"])
    # An eager target keeps its own.
    assert off.compile.target_attention_of("cuda", 3072, packing=False) == "sdpa"
    told = load_config("nographs", sets=["compile.target_attention=sdpa"])
    assert told.compile.target_attention_of("cuda", 3072, packing=False) == "sdpa"
    forced = load_config("nographs", sets=["compile.target_attention=flex"])
    assert forced.compile.target_attention_of("cuda", 96, packing=False) == "flex"
    causal = load_config("nographs", sets=["compile.target_attention=causal", "train.packing=false"])
    assert causal.compile.target_attention_of("cpu", 96, packing=False) == "causal"
    with pytest.raises(ConfigError, match="target_attention"):
        load_config("nographs", sets=["compile.target_attention=dense"])


def test_causal_target_attention_with_packed_rows_is_refused_with_the_way_out():
    with pytest.raises(ConfigError) as refused:
        load_config("nographs", sets=["compile.target_attention=causal"])  # packing is on by default
    message = str(refused.value)
    assert "compile.target_attention=causal with train.packing=true" in message
    assert "set train.packing=false, or compile.target_attention to auto or flex" in message
