"""Corpus -> token store: streaming readers, chat templates, tokenizers, the memory-mapped TokenStore, length
statistics (`stats`), the held-out split (`split`) and the batch layout every stage shares (`batch`). See the
module docstrings for formats and units."""

from dflash_lib.data.readers import (BUNDLED_SOURCE, ROLE_MAP, SKIP_REASONS, Conversation, ConversationStream,
                                     DataError, LoadReport, Skip, load_conversations, normalize_record, resolve_source)
from dflash_lib.data.stats import LengthSummary, skip_table, summarize_lengths, summarize_store
from dflash_lib.data.store import (STORE_FORMAT_VERSION, StoreSettings, TokenStore, build_token_store,
                                   build_token_store_from_config)
from dflash_lib.data.templates import (TEMPLATES, ChatMLTemplate, HFChatTemplate, Segment, TemplateError, get_template,
                                       render)
from dflash_lib.data.tokenizers import (ChatTokenizer, EncodedBatch, HFTokenizer, QwenBPETokenizer, load_tokenizer,
                                        tokenizer_identity)

__all__ = [
    "BUNDLED_SOURCE", "ROLE_MAP", "SKIP_REASONS", "STORE_FORMAT_VERSION", "TEMPLATES", "ChatMLTemplate",
    "ChatTokenizer", "Conversation", "ConversationStream", "DataError", "EncodedBatch", "HFChatTemplate",
    "HFTokenizer", "LengthSummary", "LoadReport", "QwenBPETokenizer", "Segment", "Skip", "StoreSettings", "TemplateError",
    "TokenStore", "build_token_store", "build_token_store_from_config", "get_template", "load_conversations",
    "load_tokenizer", "normalize_record", "render", "resolve_source", "skip_table", "summarize_lengths",
    "summarize_store", "tokenizer_identity",
]
