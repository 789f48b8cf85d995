"""conf/ travels inside the wheel as vlmprobe/conf, so an installed (non-editable) vlmprobe finds its configs
(vlmprobe.paths); a checkout keeps them beside the package. Everything else is in pyproject.toml."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithConf(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:  # an editable install reads conf/ from the checkout
            self.copy_tree("conf", os.path.join(self.build_lib, "vlmprobe", "conf"))


setup(cmdclass={"build_py": BuildWithConf})
