"""A prefix saved by one run and continued by later ones (Pie's KV export/import by name):
``save-prefix`` prefills a prompt once and pins it; ``continue`` forks from it and
generates; ``forget`` unpins it."""

from pie_sdk import Context


def save_prefix(model, prompt, name):
    ctx = Context(model).user(prompt).cue().flush()
    ctx.save(name, overwrite=True)
    n = len(ctx)
    ctx.drop()
    return str(n)


def resume(model, name, n):
    return Context.open(name, model).generate(max_tokens=int(n))


def forget(model, name):
    Context.delete_saved(name, model)
    return "ok"
