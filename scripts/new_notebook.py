"""Write a stage notebook skeleton: title, a `parameters` cell, a setup cell (used once per stage)."""
import sys

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

PARAMS = '''# Parameters (papermill overrides these; the defaults run the embedded CPU target)
params_file = "../params/smollm2-135m.yaml"
run_dir = None  # None: outputs/<run.name> of params_file; an existing run there is opened (its finished
                # stages are read, not redone), and the setup cell below says which run it is
# overrides: a list of "section.key=value" strings
overrides = []'''


def make(path: str, title: str, body_md: str, code: list[str]) -> None:
    p = new_code_cell(PARAMS)
    p.metadata["tags"] = ["parameters"]
    cells = [new_markdown_cell(f"# {title}\n\n{body_md}"), p,
             new_code_cell("from eagle3.notebook import setup\n\n"
                           "params, run_dir = setup(params_file, run_dir, overrides)  # displays which run directory this is")]
    cells += [new_code_cell(c) for c in code]
    nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "eagle3", "display_name": "eagle3 (.venv)", "language": "python"},
                                              "language_info": {"name": "python"}})
    nbformat.write(nb, path)


if __name__ == "__main__":
    make(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
