"""The build step pyproject.toml cannot express: the Megatron-LM patches live in the repository's top-level
patches/ (outside the package), and the wheel ships them as megatron_cp_plugin/megatron_lm/patches/*.patch.
Everything else is in pyproject.toml. An editable install reads them from patches/ in place
(megatron_cp_plugin/megatron_lm/patching.py: patch_dir)."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithPatches(build_py):
    def run(self):
        super().run()
        if self.editable_mode:                       # the source tree is used in place
            return
        dst = Path(self.build_lib) / "megatron_cp_plugin" / "megatron_lm" / "patches"
        dst.mkdir(parents=True, exist_ok=True)
        for patch in sorted((HERE / "patches").glob("*.patch")):
            self.copy_file(str(patch), str(dst / patch.name))


setup(cmdclass={"build_py": BuildPyWithPatches})
