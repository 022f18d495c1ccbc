import ast
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

# Runs torch_fsdp_ext_startup at interpreter start-up when TORCH_FSDP_EXT_AUTOLOAD is set.
STARTUP_PTH = "torch_fsdp_ext.pth"


def failures() -> tuple[str, dict]:
    """HEADLINE and FAILURES of torch_fsdp_ext/_failures.py, read without importing the package (nor torch)."""
    with open(os.path.join("torch_fsdp_ext", "_failures.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)}
    return found["HEADLINE"], found["FAILURES"]


HEADLINE, FAILURES = failures()


class BuildPyWithStartupPth(build_py):
    """Put ``torch_fsdp_ext.pth`` at the top of site-packages, for regular and editable installs.

    Note: a regular wheel takes what build_py leaves in ``build_lib``; an editable (PEP 660)
    wheel takes only its packages' finder from there and packs the ``install_lib`` folder.
    """

    def run(self) -> None:
        super().run()
        target = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        self.copy_file(STARTUP_PTH, os.path.join(target, STARTUP_PTH), preserve_mode=False)


setup(
    name="torch_fsdp_ext",
    version="0.1.0",
    description=f"Repairs {HEADLINE}: {'; '.join(FAILURES.values())}.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    license_files=["LICENSE"],
    packages=find_packages(include=["torch_fsdp_ext", "torch_fsdp_ext.*"]),
    py_modules=["torch_fsdp_ext_startup"],
    cmdclass={"build_py": BuildPyWithStartupPth},
    python_requires=">=3.9",
    # Never force a torch upgrade: any release from 2.5 on is accepted as installed.
    install_requires=["torch>=2.5"],
    extras_require={
        # What python -m torch_fsdp_ext demo needs (a tiny DeepSeek-V3 through accelerate's FSDP2 path): the
        # releases the test extra holds. Neither installs or replaces torch where torch>=2.5 is installed.
        "demo": ["transformers>=5.23.0", "accelerate>=1.15.0"],
        # Only for running the test suite (python -m pytest test -q): the libraries its integration
        # tests train with (test/test_integration.py, test/test_upcast_contract.py and
        # test/test_integrations_tools.py skip without them). lightning is the release
        # docs/integrations.md measured; it requires torch>=2.1 and installs no other torch.
        "test": [
            "pytest",
            "expecttest",
            "hypothesis",
            "numpy",
            "transformers>=5.23.0",
            "peft>=0.21.2",
            "accelerate>=1.15.0",
            "torchao>=0.18.0",
            "bitsandbytes>=0.50.2",
            "lightning==2.6.6",
        ],
    },
    entry_points={"console_scripts": ["torch-fsdp-ext=torch_fsdp_ext.__main__:main"]},
    classifiers=[
        "Development Status :: 4 - Beta",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
