"""`mlc_lora chat` on the tiny model."""

from mlc_lora.cli.main import main


def test_chat_one_shot_prints_the_greedy_reply(tiny_chat, engine, capsys):
    want = engine.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                          temperature=0).choices[0].message.content
    assert main(["chat", str(tiny_chat[1]), "--prompt", "Hi", "--max-tokens", "12"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_chat_bad_arguments_give_a_clear_error(tiny_chat, capsys):
    assert main(["chat", str(tiny_chat[1]), "--prompt", "Hi", "--max-tokens", "0"]) == 1
    assert "max_tokens must be an integer >= 1" in capsys.readouterr().err
