"""Root of the test tree.

pytest imports this file with the tests directory on ``sys.path`` (this tree has no
``__init__.py`` files), which is what lets every area import the shared helpers in
``tests/support`` as ``support``.
"""
