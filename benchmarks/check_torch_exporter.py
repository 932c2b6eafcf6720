"""Convert tiny random models of nine encoder/classifier families with one exporter (argv[1]: torch or optimum) and print whether the check against torch passes."""
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers as T
from slimml.convert import ConvertConfig, ExportConfig, convert
from slimml.convert.sources import default_model_dir
tok = T.AutoTokenizer.from_pretrained(str(default_model_dir()))
S = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=130)
fams = {
 "distilbert": lambda: T.DistilBertModel(T.DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=2, hidden_dim=64)),
 "roberta": lambda: T.RobertaModel(T.RobertaConfig(**S)),
 "xlm-roberta-cls": lambda: T.XLMRobertaForSequenceClassification(T.XLMRobertaConfig(**S, num_labels=3)),
 "mpnet": lambda: T.MPNetModel(T.MPNetConfig(**S)),
 "electra-tok": lambda: T.ElectraForTokenClassification(T.ElectraConfig(**S, embedding_size=32, num_labels=5)),
 "deberta-v2": lambda: T.DebertaV2Model(T.DebertaV2Config(**S)),
 "bert-qa": lambda: T.BertForQuestionAnswering(T.BertConfig(**S)),
 "bert-mlm": lambda: T.BertForMaskedLM(T.BertConfig(**S)),
 "albert": lambda: T.AlbertModel(T.AlbertConfig(**S, embedding_size=16)),
}
exp = sys.argv[1] if len(sys.argv) > 1 else "torch"
work = Path(tempfile.mkdtemp(prefix="slimml-families-"))
for name, make in fams.items():
    torch.manual_seed(0)
    root = work / name
    make().eval().save_pretrained(root / "src"); tok.save_pretrained(root / "src")
    try:
        r = convert(root / "src", root / "art", ConvertConfig(export=ExportConfig(exporter=exp), measure_latency=False))
        print(T.__version__, exp, name, "OK", r.task, "max abs diff vs torch", r.checks.get("max_abs_diff_vs_torch"))
    except Exception as e:
        print(T.__version__, exp, name, "FAIL", type(e).__name__, str(e)[:300])
shutil.rmtree(work, ignore_errors=True)
