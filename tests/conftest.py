"""Shared fixtures: tiny random checkpoints (made here, never downloaded) and HF reference outputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

# One torch thread per engine unless a test asks for more (before torch is imported; the workers the
# tests start inherit it). Tests run several engine processes at once on a 2-core machine, and more
# OpenMP threads than cores wait on each other: the speculating decode worker's end-to-end test took
# 159 s with torch's default of 2 threads and 30 s with 1 on a loaded machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import redis
import torch

from bench.ports import free_port
from engine.tiny_model import create_tiny_model

# Large enough that logits are far from flat, so greedy parity is not decided by rounding.
WEIGHT_SCALE = 4.0


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``make(arch, **config_overrides)`` -> checkpoint dir, cached per arguments for the session."""
    cache: dict[str, Path] = {}

    def make(arch: str = "llama", **kw) -> Path:
        key = json.dumps([arch, sorted(kw.items())], default=str)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            kw.setdefault("weight_scale", WEIGHT_SCALE)
            kw.setdefault("randomize_all", True)
            cache[key] = create_tiny_model(path, arch, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def hf_greedy():
    """``ref(model_dir, prompt_ids, max_new_tokens)`` -> HF ``generate`` greedy continuation (EOS ignored)."""
    import transformers

    models: dict[Path, transformers.PreTrainedModel] = {}

    def ref(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
        if model_dir not in models:
            m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            m.generation_config.eos_token_id = None
            models[model_dir] = m
        return _hf_generate(models[model_dir], prompt, max_new_tokens)

    return ref


def _hf_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """A transformers model's greedy continuation of ``prompt``."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="session")
def lora_adapter_factory(tmp_path_factory):
    """``make(model_dir, seed, r=8, targets=LORA_TARGETS, **lora_config)`` -> a PEFT adapter directory
    written by ``peft`` itself (the reference format), its A and B random (PEFT starts B at zero, an
    adapter that changes nothing) and large enough to change greedy output."""
    import peft
    import transformers

    cache: dict[str, Path] = {}

    def make(model_dir: Path, seed: int, r: int = 8, targets=LORA_TARGETS, scale: float = 0.5, **kw) -> Path:
        key = json.dumps([str(model_dir), seed, r, list(targets), scale, sorted(kw.items())], default=str)
        if key not in cache:
            base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            config = peft.LoraConfig(
                r=r, lora_alpha=kw.pop("lora_alpha", 2 * r), target_modules=list(targets), **kw
            )
            model = peft.get_peft_model(base, config)
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_" in name:
                        p.copy_(scale * torch.randn(p.shape, generator=gen))
            path = tmp_path_factory.mktemp(f"lora-{seed}")
            model.save_pretrained(path)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_lora_greedy():
    """``ref(model_dir, adapter_dir, prompt_ids, max_new_tokens)`` -> HF transformers + peft greedy
    continuation (EOS ignored); ``adapter_dir`` None: the base model."""
    import peft
    import transformers

    models: dict[tuple, object] = {}

    def ref(model_dir: Path, adapter: Path | None, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (model_dir, adapter)
        if key not in models:
            m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            if adapter is not None:
                m = peft.PeftModel.from_pretrained(m, adapter)
            m.generation_config.eos_token_id = None
            models[key] = m.eval()
        return _hf_generate(models[key], prompt, max_new_tokens)

    return ref


class RedisServer:
    def __init__(self, tmp_path, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed (scripts/test.sh installs it: apt-get install -y redis-server)"
            )
        self.binary = binary
        self.dir = tmp_path
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.password = password
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, password=self.password, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.kill()


@pytest.fixture
def redis_server_factory(tmp_path):
    """``make(password=None)`` -> another real redis-server, killed after the test."""
    servers: list[RedisServer] = []

    def make(password: str | None = None) -> RedisServer:
        servers.append(RedisServer(tmp_path / f"redis-{len(servers)}", password))
        return servers[-1]

    yield make
    for server in servers:
        server.kill()


@pytest.fixture(scope="module")
def module_redis_server(tmp_path_factory):
    """A real redis-server shared by one test module (e.g. one long-lived ``pdserve serve``)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.kill()


# The tests that run one at a time, on one xdist worker (scripts/test.sh runs two): the end-to-end
# tier (a Ray cluster and a Serve application each) and the benchmarks' tests (several processes
# each, measuring CPU). The other worker takes the rest, test by test. (Two groups, one per worker,
# ran slower: both workers then run many processes at once on two cores.)
SERIAL_DIRS = ("tests/deploy/", "tests/bench/")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """One work unit for the serial tests, one per test elsewhere. (xdist's own ``loadgroup`` marks
    its groups in ``item._nodeid``, which pytest 9 no longer reads: the groups here come from paths.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SerialTier(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "serial" if nodeid.startswith(SERIAL_DIRS) else nodeid

    return SerialTier(config, log)


def pytest_addoption(parser):
    parser.addoption(
        "--soak-seconds",
        type=float,
        default=0.0,
        help="reliability suite: keep repeating the fault cycle under load this long (e.g. 600)",
    )


@pytest.fixture(scope="session")
def byte_level_model(tmp_path_factory) -> Path:
    """The tiny random Llama (as ``tiny_llama``) with a byte-level BPE tokenizer: every string is
    expressible (JSON, regexes, tool calls); ids 0-2 are pad, BOS, EOS as in the model's config."""
    from engine.tiny_model import create_byte_level_model

    path = create_byte_level_model(
        tmp_path_factory.mktemp("tiny-byte-level"), weight_scale=WEIGHT_SCALE, randomize_all=True
    )
    return path
