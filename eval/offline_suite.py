"""Build the offline suite: ``python -m eval.offline_suite [--output-dir DIR] [--examples 6] [--seed 0]``.

A thin shim over ``kvcompress.longbench.offline_suite`` (what the tasks are and how they are drawn).
"""

from kvcompress.longbench.offline_suite import main

if __name__ == "__main__":
    main()
