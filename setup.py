"""Only the native extension: setuptools cannot take cffi_modules from pyproject.toml (everything else is there)."""
from setuptools import setup

setup(cffi_modules=["ktinject/native/build.py:ffibuilder"])
