"""08_lightning's exercises: each checker accepts the package's solution and another correct answer, and rejects
the notebook's unedited skeleton and another plausible mistake, saying what is wrong. Exercise 2 runs on two
engines: a metric logged without sync_dist=True gives each rank its own number to stop on."""
from __future__ import annotations

import pytest
from answers import defined
from conftest import exercise_cell

pytest.importorskip("lightning")
from tutorial.lessons import lightning as lesson  # noqa: E402


TRAINING_STEP = """
import torch
from tutorial import train_lightning
class MyClassifier(train_lightning.Classifier):
    def training_step(self, batch, batch_idx):
        X, y = batch
        loss = torch.nn.functional.cross_entropy(self(X), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        {end}
"""


def test_exercise_1_training_step(capsys):
    assert lesson.check_training_step(lesson.SolutionClassifier)
    unedited = defined("import torch\nfrom tutorial import train_lightning\n"  # as the notebook imported them
                       + exercise_cell("08_lightning", "### Exercise 1"), "MyClassifier")
    assert not lesson.check_training_step(unedited)
    assert "training_step returned None" in capsys.readouterr().out


def test_exercise_1_accepts_a_dict_and_names_a_number(capsys):
    assert lesson.check_training_step(defined(TRAINING_STEP.format(end='return {"loss": loss}'), "MyClassifier"))
    assert not lesson.check_training_step(defined(TRAINING_STEP.format(end="return loss.item()"), "MyClassifier"))
    assert "Lightning stopped: MisconfigurationException" in capsys.readouterr().out


VALIDATION = """
from tutorial import train_lightning
class MyValidation(train_lightning.Classifier):
    def validation_step(self, batch, batch_idx):
        import torch.nn.functional as F  # runs on the engines
        X, y = batch
        self.log("test_loss", F.cross_entropy(self(X), y){sync})
"""


def notebook_exercise_2(name: str):
    """What exercise 2's cell defines, unedited (the notebook imported train_lightning before)."""
    return defined("from tutorial import train_lightning\n" + exercise_cell("08_lightning", "### Exercise 2"), name)


def test_exercise_2_settings_are_read_first(capsys):
    from lightning.pytorch.callbacks import EarlyStopping
    assert not lesson.check_early_stopping(notebook_exercise_2("my_stopper"), notebook_exercise_2("MyValidation"))
    out = capsys.readouterr().out  # the notebook's stored output: no engine started for settings that are wrong
    assert out == ("  - monitor='val_loss' is never logged (train_lightning logs test_loss, test_accuracy, train_loss): "
                   "Lightning would stop with an error after the first epoch\n"
                   "  - patience=0 stops at the first epoch without improvement; one noisy epoch would end the run\n"
                   "early stopping watches the test loss sensibly: False\n")
    assert not lesson.check_early_stopping(EarlyStopping(monitor="test_accuracy", mode="min", patience=2))
    assert "mode='min': test_accuracy improves when it goes up, so mode='max'" in capsys.readouterr().out


def test_exercise_2_on_two_ranks(cluster, capsys):
    assert lesson.check_early_stopping(lesson.early_stopping_solution(), lesson.SolutionValidation, cluster)
    capsys.readouterr()  # the skeleton's class with the settings fixed: each rank stops on its own half
    assert not lesson.check_early_stopping(lesson.early_stopping_solution(), notebook_exercise_2("MyValidation"),
                                           cluster)
    out = capsys.readouterr().out
    assert "after epoch 0 the ranks saw test_loss = " in out and "sync_dist=True" in out, out


def test_exercise_2_accepts_another_stopper_and_an_epoch_mean_on_its_own_engines():
    from lightning.pytorch.callbacks import EarlyStopping
    other = defined(VALIDATION.format(sync=", sync_dist=True, on_epoch=True"), "MyValidation")
    stopper = EarlyStopping(monitor="test_loss", patience=3, min_delta=1e-3)
    assert lesson.check_early_stopping(stopper, other)  # starts 2 engines for the check and stops them
