from setuptools import find_packages, setup

setup(
    name="torch_fsdp_ext",
    version="0.1.0",
    description="Repairs FSDP2 (fully_shard) mixed-precision failures: mixed parameter dtypes and "
    "activation-checkpoint recompute.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    license_files=["LICENSE"],
    packages=find_packages(include=["torch_fsdp_ext", "torch_fsdp_ext.*"]),
    python_requires=">=3.9",
    # Never force a torch upgrade: any release from 2.5 on is accepted as installed.
    install_requires=["torch>=2.5"],
    extras_require={
        # Only for running the test suite (python -m pytest test -q): transformers and peft
        # for the integration tests (test/test_integration.py skips without them).
        "test": ["pytest", "expecttest", "numpy", "transformers>=5.23.0", "peft>=0.21.2"],
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
