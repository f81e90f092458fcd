"""Evaluation: a bridge to lm-evaluation-harness (``pip install 'lazoo[eval]'``) and lazoo's local tasks.

``lazoo.eval.main(argv)`` is the ``lazoo eval`` command: saved model folders in, one table out. The pieces
are usable on their own::

    from lazoo.eval import make_lm, prepare_tasks, evaluate
    folder = prepare_tasks("/tmp/lazoo-tasks")              # data + YAMLs with absolute paths
    results = evaluate(make_lm(model, tokenizer), ["lazoo_kjv_ppl"], folder, limit=8)

Importing this package does not import lm-eval; the functions that need it do, with a clear error if it is
missing. See docs/eval.md.
"""

from .harness import (
                      check_args,
                      check_model_folder,
                      evaluate,
                      format_table,
                      load_model,
                      main,
                      make_lm,
                      metrics_of,
                      run,
                      task_manager,
)
from .local_tasks import TASKS, mqar_docs, mqar_word, mqar_word_tokenizer, prepare_tasks

__all__ = ["TASKS", "check_args", "check_model_folder", "evaluate", "format_table", "load_model", "main", "make_lm",
           "metrics_of", "mqar_docs", "mqar_word", "mqar_word_tokenizer", "prepare_tasks", "run", "task_manager"]
