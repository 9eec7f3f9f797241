// Test driver for SentencePiece models (tests/data/test_sentencepiece.py): reads a JSON array on
// stdin and prints a JSON array.
//   sp_tool encode <model> [bos] [eos]   strings -> id lists
//   sp_tool decode <model>               id lists -> strings
//   sp_tool info <model>                 (no input) vocab size and special ids
// Exit 2 on an InputError (bad model, bad id), with its message on stderr.
#include <iostream>
#include <iterator>
#include <string>

#include "colossal/core/error.h"
#include "colossal/core/json.h"
#include "colossal/data/sentencepiece.h"

using namespace colossal;

int main(int argc, char** argv) {
  try {
    if (argc < 3) {
      std::cerr << "usage: sp_tool encode|decode|info <model> [bos] [eos]\n";
      return 1;
    }
    const std::string cmd = argv[1];
    auto sp = data::SentencePieceTokenizer::from_file(argv[2]);
    json::Value out = json::Value::array();
    if (cmd == "info") {
      out = json::Value::object();
      out.set("vocab_size", sp.vocab_size());
      out.set("bos", sp.bos_id() ? json::Value(*sp.bos_id()) : json::Value());
      out.set("eos", sp.eos_id() ? json::Value(*sp.eos_id()) : json::Value());
      out.set("unk", sp.unk_id());
      out.set("piece_0", sp.id_to_piece(0));
      out.set("known", sp.piece_to_id(sp.id_to_piece(sp.vocab_size() - 1)).value_or(-1));
      out.set("unknown", sp.piece_to_id("no such piece, surely").value_or(-1));
    } else {
      std::string text((std::istreambuf_iterator<char>(std::cin)),
                       std::istreambuf_iterator<char>());
      const json::Value in = json::parse(text, "stdin");
      bool bos = false, eos = false;
      for (int i = 3; i < argc; ++i) {
        bos = bos || std::string(argv[i]) == "bos";
        eos = eos || std::string(argv[i]) == "eos";
      }
      for (const auto& item : in.as_array()) {
        if (cmd == "encode") {
          json::Value ids = json::Value::array();
          for (int32_t id : sp.encode(item.as_string(), bos, eos)) ids.push_back(id);
          out.push_back(std::move(ids));
        } else if (cmd == "decode") {
          std::vector<int32_t> ids;
          for (const auto& v : item.as_array()) ids.push_back(static_cast<int32_t>(v.as_int()));
          out.push_back(sp.decode(ids));
        } else {
          std::cerr << "sp_tool: unknown command " << cmd << "\n";
          return 1;
        }
      }
    }
    std::cout << out.dump() << "\n";
    return 0;
  } catch (const InputError& e) {
    std::cerr << "sp_tool: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "sp_tool: " << e.what() << "\n";
    return 1;
  }
}
