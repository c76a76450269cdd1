"""Stand-in for pip's get-pip.py, which ansible-test downloads from ci-files.testing.ansible.com to
put pip into each sanity test's virtual environment. Where that host cannot be reached, the
collection's sanity run (scripts/collection_sanity.sh) puts this file in ansible-test's cache
instead: ensurepip installs the pip that ships with Python, and that pip then installs what
ansible-test asked for from the package index pip is configured to use.

ansible-test runs it as `python get_pip.py [pip install options] PACKAGES [--no-setuptools] [--no-wheel]`.
"""

from __future__ import annotations

import ensurepip
import subprocess
import sys

GET_PIP_ONLY = {"--no-setuptools", "--no-wheel"}


def main() -> int:
    ensurepip.bootstrap(upgrade=True)
    arguments = [arg for arg in sys.argv[1:] if arg not in GET_PIP_ONLY]
    return subprocess.call([sys.executable, "-m", "pip", "install", *arguments])


if __name__ == "__main__":
    sys.exit(main())
