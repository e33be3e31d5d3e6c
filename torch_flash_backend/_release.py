"""A torch version's release, the unit of its C++ ABI; plain Python, so that
setup.py reads the same rule before the package can import."""


def release(version: str) -> str:
    """"2.11.0+cu130" -> "2.11": releases differ in their C++ ABI."""
    return ".".join(version.split("+")[0].split(".")[:2])
