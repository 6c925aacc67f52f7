"""Maps the two source roots onto one package: libs/kubesgl -> kubesgl, services/ -> kubesgl.services."""

from setuptools import find_packages, setup

packages = ["kubesgl", "kubesgl.services"]
packages += ["kubesgl." + p for p in find_packages("libs/kubesgl")]
packages += ["kubesgl.services." + p for p in find_packages("services")]
setup(packages=packages)
