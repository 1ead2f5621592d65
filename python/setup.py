"""Builds moerl_ep._C with the project's CMake (target moerl_ep_python) for the running interpreter.

    python3 -m pip install --no-build-isolation ./python

MOERL_CMAKE_ARGS adds configure arguments (e.g. "-DMOERL_WITH_CUDA=OFF"); CMAKE_BUILD_PARALLEL_LEVEL
sets the build's parallelism (default 2).
"""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent.parent


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        build = Path(self.build_temp).resolve() / 'cmake'
        configure = ['cmake', '-S', str(ROOT), '-B', str(build), '-DCMAKE_BUILD_TYPE=Release',
                     '-DMOERL_WITH_PYTHON=ON', '-DMOERL_BUILD_TESTS=OFF', '-DMOERL_WITH_TORCH=OFF',
                     f'-DMOERL_PYTHON_EXECUTABLE={sys.executable}']
        if shutil.which('ninja'):
            configure += ['-G', 'Ninja']
        if shutil.which('ccache'):
            configure += ['-DCMAKE_CXX_COMPILER_LAUNCHER=ccache']
        configure += shlex.split(os.environ.get('MOERL_CMAKE_ARGS', ''))
        env = dict(os.environ)
        env.setdefault('CMAKE_BUILD_PARALLEL_LEVEL', '2')
        subprocess.check_call(configure, env=env)
        subprocess.check_call(['cmake', '--build', str(build), '--target', 'moerl_ep_python'], env=env)
        built = next((build / 'python' / 'moerl_ep').glob('_C*.so'))
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target)


setup(packages=['moerl_ep'], ext_modules=[Extension('moerl_ep._C', sources=[])], cmdclass={'build_ext': CMakeBuild})
