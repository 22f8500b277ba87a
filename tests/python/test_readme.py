"""The README's two commands work as written on a root machine without sudo.

A newcomer on a root box (a container, a CI machine) copies the commands as
they stand; with a `sudo` prefix they get "command not found" there. The
README shows the root form in its block and names the sudo form beside it.
"""
import os
import re

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def two_commands_block():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "no sh block under 'The two commands'"
    return section, [line.split("#")[0].strip() for line in block.group(1).splitlines()
                     if line.strip()]


def test_the_two_commands_run_as_root_as_written():
    section, commands = two_commands_block()
    assert commands == ["scripts/demo.sh", "scripts/test.sh"], commands
    for command in commands:
        path = os.path.join(ROOT, command)
        assert os.path.isfile(path) and os.access(path, os.X_OK), f"{command} is not executable"
    # Both forms are named: as root, and from an account with sudo.
    assert "As root" in section, section
    assert "`sudo scripts/demo.sh`" in section and "`sudo scripts/test.sh`" in section, section


def test_no_readme_command_needs_sudo_to_exist():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    with_sudo = [line for block in blocks for line in block.splitlines()
                 if line.lstrip().startswith("sudo ")]
    assert not with_sudo, f"commands written for sudo: {with_sudo}"
