"""Package layout: `services/` installs as `tokenfleet.services`, not as a top-level `services`.

Metadata lives in pyproject.toml; this file only computes the package list, which a static
pyproject table cannot express for a renamed folder.
"""

from setuptools import find_packages, setup

core = find_packages(include=["tokenfleet", "tokenfleet.*"])
services = ["tokenfleet.services"] + [f"tokenfleet.services.{p}" for p in find_packages("services")]

setup(
    packages=core + services,
    package_dir={"tokenfleet.services": "services"},
)
