#include "server/labels.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

google::protobuf::Map<std::string, std::string> Labels(std::initializer_list<std::pair<std::string, std::string>> l) {
  google::protobuf::Map<std::string, std::string> m;
  for (const auto& [k, v] : l) m[k] = v;
  return m;
}

TEST(LabelsTest, KubernetesKeysAndValuesAreAccepted) {
  EXPECT_TRUE(CheckLabels(Labels({{"team", "nlp"},
                                  {"stage", ""},
                                  {"example.com/owner", "a.b_c-9"},
                                  {"A1", std::string(63, 'v')},
                                  {std::string(63, 'k'), "x"}}))
                  .ok());
}

TEST(LabelsTest, BadKeysAndValuesNameTheKeyAndWhatWasExpected) {
  struct Case {
    std::string key, value, want;
  } cases[] = {
      {"", "x", "labels.key: expected a name of 1 to 63 characters"},
      {"-team", "x", "labels.key: expected a name"},
      {"team!", "x", "got 'team!'"},
      {std::string(64, 'k'), "x", "(64 characters)"},
      {"Example.com/owner", "x", "labels.key: expected a DNS-subdomain prefix before '/'"},
      {"Example.com/owner", "x", "got 'Example.com' in 'Example.com/owner'"},
      {"/owner", "x", "got '' in '/owner'"},
      {"example.com/", "x", "labels.key: expected a name"},
      {"team", "nlp team", "labels.value: of the key 'team': expected an empty value or 1 to 63 characters"},
      {"team", std::string(64, 'v'), "of the key 'team': expected an empty value"},
      {"team", "-x", "got '-x'"},
  };
  for (const Case& c : cases) {
    absl::Status s = CheckLabels(Labels({{c.key, c.value}}));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.key << "=" << c.value;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.want)) << c.key << "=" << c.value;
  }
  google::protobuf::Map<std::string, std::string> many;
  for (int i = 0; i <= kMaxLabels; ++i) many["k" + std::to_string(i)] = "v";
  EXPECT_THAT(std::string(CheckLabels(many).message()), HasSubstr("expected at most 64 labels, got 65"));
}

TEST(LabelsTest, SelectorMatchesEveryRequirement) {
  auto sel = LabelSelector::Parse("team=nlp, stage!=dev");
  ASSERT_TRUE(sel.ok()) << sel.status();
  EXPECT_TRUE(sel->Matches(Labels({{"team", "nlp"}, {"stage", "prod"}})));
  EXPECT_TRUE(sel->Matches(Labels({{"team", "nlp"}})));  // != holds when absent
  EXPECT_FALSE(sel->Matches(Labels({{"team", "nlp"}, {"stage", "dev"}})));
  EXPECT_FALSE(sel->Matches(Labels({{"team", "vision"}})));
  EXPECT_FALSE(sel->Matches(Labels({})));

  auto presence = LabelSelector::Parse("owner,!frozen,team==nlp");
  ASSERT_TRUE(presence.ok()) << presence.status();
  EXPECT_TRUE(presence->Matches(Labels({{"owner", ""}, {"team", "nlp"}})));
  EXPECT_FALSE(presence->Matches(Labels({{"team", "nlp"}})));
  EXPECT_FALSE(presence->Matches(Labels({{"owner", "x"}, {"team", "nlp"}, {"frozen", ""}})));

  auto empty_value = LabelSelector::Parse("stage=");
  ASSERT_TRUE(empty_value.ok());
  EXPECT_TRUE(empty_value->Matches(Labels({{"stage", ""}})));
  EXPECT_FALSE(empty_value->Matches(Labels({{"stage", "x"}})));
  EXPECT_FALSE(empty_value->Matches(Labels({})));

  auto all = LabelSelector::Parse("  ");
  ASSERT_TRUE(all.ok());
  EXPECT_TRUE(all->empty());
  EXPECT_TRUE(all->Matches(Labels({})));
}

TEST(LabelsTest, BadSelectorsNameTheRequirement) {
  struct Case {
    std::string text, want;
  } cases[] = {
      {"team=nlp,", "label_selector: requirement '': expected key=value, key!=value, key or !key"},
      {"team in (a,b)", "set-based requirements (in, notin) are not supported"},
      {"=nlp", "requirement '=nlp': key: expected a name"},
      {"team=nl p", "requirement 'team=nl p': value: expected an empty value"},
      {"!", "requirement '!': key"},
      {"bad key", "set-based requirements"},
  };
  for (const Case& c : cases) {
    auto s = LabelSelector::Parse(c.text);
    ASSERT_FALSE(s.ok()) << c.text;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(c.want)) << c.text;
  }
  EXPECT_THAT(std::string(LabelSelector::Parse(std::string(5000, 'a')).status().message()),
              AllOf(HasSubstr("label_selector"), HasSubstr("at most 4096 characters")));
}

}  // namespace
}  // namespace plateau
