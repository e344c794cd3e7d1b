"""``python -m elastic_launch``: the same as ``elasticrun``."""

from elastic_launch.launcher.cli import console_main

if __name__ == "__main__":
    console_main()
