"""README.md's command blocks, as a user copies them: the first screen's two commands and each section's blocks.
Read by tests/dist/test_demo.py (which runs them) and tests/unit/test_docs.py (which checks them against CI)."""

import re

from tests.runs import ROOT


def readme_blocks(section: str) -> list[str]:
    """The ```bash blocks of README.md's first screen (section "first screen": everything before the first `## `)
    or of the `## <section>` section."""
    text = (ROOT / "README.md").read_text()
    if section == "first screen":
        body = text.split("\n## ", 1)[0]
    else:
        body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", body, re.S)


def commands(block: str) -> list[str]:
    """The block's command lines, comments and blank lines left out."""
    lines = [line.split(" #", 1)[0].strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


DEMO_COMMAND = "bash setup/demo.sh"
TEST_COMMAND = "bash setup/run_tests.sh"  # the first screen's second command; .ci/run runs exactly it
