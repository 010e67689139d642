"""Every deliberate error is an Eagle3Error and the old names are the same classes."""

from __future__ import annotations

import pytest

from eagle3 import errors


def test_every_error_is_an_eagle3_error_with_its_second_base():
    # bad input (params, prompt files, vocab settings, self-prompt settings, a damaged JSON file) is a
    # ValueError too
    value = {errors.ParamsError, errors.PromptsError, errors.VocabError, errors.SelfPromptError, errors.DamagedFile}
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.Eagle3Error)
        if cls is not errors.Eagle3Error:
            assert issubclass(cls, ValueError if cls in value else RuntimeError), name


def test_old_names_are_the_classes_in_errors():
    from eagle3 import evaluate, params_file, prompts, synthesize, target
    from eagle3.commands import run
    from eagle3.extract import prepare
    from eagle3.train import model
    from eagle3.vocab import render

    assert params_file.ParamsError is errors.ParamsError
    assert target.TargetError is errors.TargetError
    assert prompts.PromptError is errors.PromptsError
    assert synthesize.SynthesisError is errors.SynthesisError
    assert render.VocabError is errors.VocabError
    assert prepare.ExtractError is errors.ExtractError
    assert model.TrainError is errors.TrainError
    assert evaluate.EvaluateError is errors.EvaluateError
    assert evaluate.ParityError is errors.ParityError
    assert run.StageFailed is errors.StageFailed and run.StaleStage is errors.StaleStage


def test_parity_error_lists_the_diagnosis():
    e = errors.ParityError("tau 1.2 vs 1.5", ["d2t differs"])
    assert str(e) == "tau 1.2 vs 1.5\nDiagnosis:\n  - d2t differs"
    assert e.diagnosis == ["d2t differs"]
    with pytest.raises(errors.Eagle3Error):
        raise e
