"""`localheap generate` end to end on a random-weight model built locally."""

import pytest

from localheap.cli import main


@pytest.fixture(scope="module")
def model_path(model_dirs):
    return str(model_dirs("llama"))


def test_generate_prints_text_and_heap_stats(model_path, tmp_path, capsys):
    prompt = tmp_path / "doc.txt"
    prompt.write_text(" ".join(f"line {i} of a long document" for i in range(300)))
    rc = main(["generate", "--model", model_path, "--backend", "mlx", "--prompt-file", str(prompt),
               "--budget", "64", "--recent", "16", "--slack", "32", "--max-tokens", "20"])
    out = capsys.readouterr()
    assert rc == 0
    assert out.out.strip(), "generated text on stdout"
    assert "tokens seen" in out.err and "evicted" in out.err
    evicted = int(out.err.split("evicted ")[1].split()[0].replace(",", ""))
    assert evicted > 1000


def test_the_program_on_mlx_leaves_torch_out_and_prints_the_same_text(model_path, tmp_path, capsys):
    """`localheap generate --backend mlx` as a program of its own never imports torch (transformers
    runs mlx-lm's tokenizer without it) and prints what the same command run from this process
    prints; a caller's main([...]) leaves its interpreter as it was."""
    import subprocess
    import sys

    import torch  # noqa: F401  (here: imported before, and still there after)

    cmd = ["generate", "--model", model_path, "--backend", "mlx", "--prompt", "The heap keeps", "--max-tokens", "12"]
    assert main(cmd) == 0
    here = capsys.readouterr().out
    probe = ("import sys; import localheap.cli as cli; sys.argv = ['localheap', *sys.argv[1:]]; rc = cli.main(); "
             "print('torch imported:', sys.modules.get('torch') is not None, file=sys.stderr); sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "torch imported: False" in run.stderr and run.stdout == here
    assert sys.modules.get("torch") is not None


def test_generate_bad_policy_is_a_usage_error(model_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", model_path, "--prompt", "x", "--policy", "lru"])
    assert e.value.code == 2


def test_generate_unknown_model_is_a_clear_error(capsys):
    rc = main(["generate", "--model", "no-such-model", "--prompt", "x", "--backend", "mlx"])
    assert rc == 2
    assert "unknown model" in capsys.readouterr().err


def test_generate_bad_heap_setting_is_a_clear_error(model_path, capsys):
    rc = main(["generate", "--model", model_path, "--prompt", "x", "--budget", "0", "--backend", "mlx"])
    assert rc == 2
    assert "budget must be >= 1" in capsys.readouterr().err


def test_generate_takes_the_penalties_and_checks_their_range(capsys):
    """The bundled model, greedy: a strong presence penalty stops the reply repeating a token it wrote;
    a penalty out of OpenAI's range is a usage error."""
    args = ["generate", "--backend", "torch", "--prompt", "The pass key", "--max-tokens", "12"]
    pytest.importorskip("torch")
    outs = []
    for extra in ([], ["--presence-penalty", "2", "--frequency-penalty", "1", "--min-p", "0.1"],
                  ["--repeat-penalty", "4", "--repeat-last-n", "-1"],
                  ["--dry-multiplier", "3", "--dry-allowed-length", "1"]):
        assert main(args + extra) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] != outs[1] and outs[0] != outs[2] and outs[0] != outs[3]
    sampled = args + ["--temperature", "1", "--seed", "3", "--mirostat", "2", "--typical-p", "0.5"]
    assert main(sampled) == 0 and capsys.readouterr().out
    for bad, says in ((["--presence-penalty", "3"], "not in [-2, 2]"), (["--repeat-penalty", "0"], "not in"),
                      (["--repeat-last-n", "-2"], "-1 (the whole context)"), (["--mirostat", "3"], "not in [0, 2]")):
        with pytest.raises(SystemExit) as e:
            main(args + bad)
        assert e.value.code == 2
        assert says in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_chat_wraps_the_prompt_in_the_template_as_the_server_does(model_path, capsys, backend):
    """`generate --chat` reads the chat the server would render for one user message (on torch
    transformers 5's apply_chat_template returned a BatchEncoding, which failed)."""
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    from localheap.models import load_backend
    from localheap.server.prompts import chat_prompt
    from localheap.server.schemas import ChatMessage

    tok = load_backend(model_path, backend).tokenizer
    want = len(chat_prompt(tok, [ChatMessage(role="user", content="hi there")]).tokens)
    assert main(["generate", "--model", model_path, "--backend", backend, "--prompt", "hi there", "--chat",
                 "--max-tokens", "3", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert f"prompt {want} tokens" in err, err


def test_chat_on_a_model_without_a_template_says_so_in_the_commands_words(model_path, tmp_path, capsys):
    import json
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(model_path, bare)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    for extra in bare.glob("chat_template.*"):
        extra.unlink()
    assert main(["generate", "--model", str(bare), "--backend", "torch", "--prompt", "hi", "--chat"]) == 2
    err = capsys.readouterr().err
    assert "--chat: this model has no chat template" in err and "leave --chat out" in err and "Traceback" not in err
