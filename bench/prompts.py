"""Benchmark prompts: windows of exactly N tokens cut from a long English text, each request its own window."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

# Successive requests start this many tokens apart (a prime, so the starts wrap around the
# text without soon repeating); no two requests of a benchmark share a prefix.
WINDOW_STRIDE_TOKENS = 61

# A few thousand tokens of ordinary prose on unrelated subjects, so prompts read like real
# requests; random token ids make a small model repeat itself, which no real workload does.
ESSAY_PARAGRAPHS = (
    "The first machines that people called computers were not machines at all. For most of the "
    "nineteenth century a computer was a person, very often a woman, who sat at a desk with a pencil, "
    "a book of logarithms and a stack of printed forms, and who worked through long columns of "
    "arithmetic for an observatory, an insurance company or a government office. Tables of the tides, "
    "of the positions of the moon and of the interest owed on a loan were all produced this way, and "
    "every table carried errors, because tired people copy digits wrongly. Charles Babbage, who spent "
    "an evening checking such tables with a friend in London, is said to have exclaimed that he wished "
    "they had been calculated by steam. His difference engine was meant to do exactly that: to turn a "
    "crank and print a table with no human hand between the arithmetic and the page.",
    "Babbage never finished his engines, partly because the workshops of his day could not hold the "
    "tolerances he needed and partly because he kept redesigning them. The idea survived him. By the "
    "end of the century Herman Hollerith had built electrical tabulators that read holes punched in "
    "cards, and the American census of 1890 was counted with them in a fraction of the time the "
    "previous one had taken. Punched cards then ran the accounts of railways, banks and armies for "
    "half a century. A clerk who had never heard of Babbage could spend a whole career feeding cards "
    "into sorters and collators, wiring plugboards by hand to tell the machines which columns to add.",
    "The war years changed the scale of the problem. Artillery tables, the design of aircraft and the "
    "breaking of enemy ciphers all demanded more arithmetic than rooms full of human computers could "
    "supply. Engineers in several countries, mostly unaware of each other, built machines out of relays "
    "and vacuum tubes. These machines were enormous, hot and fragile; a tube failed every few hours and "
    "technicians walked the aisles with baskets of spares. Yet they were fast, and once a program could "
    "be stored in the same memory as the data, a computer could change its own course as it ran. That "
    "single idea, simple to state and hard to build, is the ancestor of every program written since.",
    "Transistors replaced tubes in the nineteen fifties, and integrated circuits put many transistors "
    "on one chip of silicon in the sixties. Each step made machines smaller, cheaper and more reliable, "
    "and each step was at first dismissed as a curiosity by people who owned the previous kind. The "
    "minicomputer brought computing into laboratories and small firms; the microprocessor brought it "
    "into homes, where hobbyists soldered kits together on kitchen tables and traded programs printed "
    "in magazines. Many of the companies that dominate the industry today began in such garages and "
    "spare bedrooms, and many more that began the same way are now forgotten.",
    "Rivers shape the land more patiently than any engineer. A river in its upper course is steep and "
    "quick; it carries stones that knock against the bed and cut a narrow valley shaped like the letter "
    "V. Lower down the slope eases, the water slows and begins to wander, and the river swings from side "
    "to side across a widening floor. On the outside of each bend the current is fastest and the bank "
    "is worn away; on the inside the water is slack and drops the sand and gravel it was carrying. Over "
    "centuries the bends grow, migrate downstream and sometimes meet, so that the river takes a short "
    "cut and leaves a curved lake behind, slowly filling with reeds.",
    "Near the sea a great river may split into many channels and build a delta, pushing new land out "
    "into the water a little every year. The soil of a delta is young and rich, and people have farmed "
    "such places since farming began. They have also learned that a river does not stay where it is "
    "put. Floods that spread silt across the fields also wash away houses, and the embankments built to "
    "hold the water back raise the river bed over time, until the channel runs above the surrounding "
    "plain and a single breach can drown a province. Engineers now speak of giving rivers room: moving "
    "the banks back, letting some meadows flood on purpose, and accepting that a river is a process "
    "rather than a line on a map.",
    "Every river also carries a history of trade. Before roads were paved and railways laid, water was "
    "the cheapest way to move anything heavy, and towns grew where a river could be crossed, where two "
    "rivers met, or where the water became too shallow for seagoing ships and cargo had to be moved to "
    "smaller boats. Mills stood on weirs and ground the grain of whole districts. Canals joined one "
    "river basin to the next, with locks that lifted barges over hills one chamber at a time, and "
    "horses walked the towpaths pulling loads that a dozen carts could not have managed on the road.",
    "Bread is one of the oldest processed foods, and it is still made from almost the same four things: "
    "flour, water, salt and something to make it rise. When flour is mixed with water, two proteins in "
    "the wheat join into a stretchy network called gluten. Kneading lines up and strengthens that "
    "network, so that the dough can hold the gas produced by yeast as it feeds on the sugars in the "
    "flour. A baker judges the dough by touch more than by the clock: it should feel smooth and spring "
    "back slowly when pressed. Warm kitchens make dough rise quickly and cold ones slowly, and a slow "
    "rise usually gives a loaf with more flavour.",
    "Before commercial yeast was sold in packets, bakers kept a starter, a portion of dough left over "
    "from the previous batch and fed each day with fresh flour and water. The wild yeasts and bacteria "
    "living in it produce gas and acids together, which is why sourdough has its sharp taste and keeps "
    "longer than other bread. Some bakeries claim their starters are more than a century old. Whether "
    "or not that is true, the habit of keeping a little of yesterday to begin today is a fair summary "
    "of how most cooking traditions have been passed down: not by recipes written in books, but by "
    "watching someone else's hands and tasting what they made.",
    "A good soup follows the same logic. Onions, carrots and celery cooked slowly in fat become sweet "
    "and soft and form the base of countless dishes across Europe; other cuisines begin with garlic, "
    "ginger and chilli, or with dried fish and seaweed simmered into a clear broth. Salt is added early "
    "so that it can reach every ingredient, acid is added late so that its brightness survives, and "
    "herbs with delicate leaves are stirred in only at the very end. Cooks who follow a recipe exactly "
    "still taste as they go, because no two onions, tomatoes or pots of stock are quite the same.",
    "Lighthouses were once the most advanced machines on many coastlines. The earliest were simply "
    "fires burning on a hill or a tower, fed with wood or coal by keepers who climbed the stairs all "
    "night. Oil lamps with polished reflectors came next, and then the glass lens designed by Augustin "
    "Fresnel, which bent the light of a single flame into a beam that could be seen from more than "
    "twenty miles away. Each lighthouse was given its own pattern of flashes, so that a navigator who "
    "counted the seconds between them could tell which headland lay ahead and plot a course around the "
    "rocks below it.",
    "The keepers lived lonely and careful lives. They trimmed wicks, cleaned soot from the glass every "
    "morning, wound the clockwork that turned the lens, and wrote the weather in a logbook every few "
    "hours. On the most exposed rocks a relief boat might not reach them for weeks in a winter storm, "
    "and their families learned to live by the tides and the supply schedule. Automation ended most of "
    "that work in the late twentieth century. The lights still turn, watched now by sensors and radio "
    "links, and many of the keepers' cottages have become museums or holiday lets for people who want "
    "to spend a quiet week beside the sea.",
    "Honeybees organise themselves without any bee being in charge. A colony of several tens of "
    "thousands of workers divides its labour mainly by age: young bees clean cells and feed larvae, "
    "middle-aged bees build comb, store food and guard the entrance, and the oldest fly out to gather "
    "nectar and pollen. When a forager finds a rich patch of flowers she returns to the hive and "
    "performs a dance on the comb. The angle of her run relative to the vertical tells the others the "
    "direction of the flowers relative to the sun, and the length of the run tells them how far away "
    "they are.",
    "When a colony grows too large, the old queen leaves with about half of the workers, and the swarm "
    "hangs from a branch while scouts search for a new home. Each scout that finds a promising hollow "
    "comes back and dances for it, and other scouts go to inspect the site and dance for it in turn if "
    "they approve. Poor sites lose their supporters as the scouts' enthusiasm fades, good ones gain "
    "more, and within a day or two the swarm reaches a decision and flies off together. Biologists "
    "have compared the process to a well-run committee, one that manages to avoid both stubbornness "
    "and haste.",
    "The printing press did not invent reading, but it changed who could afford to read. A hand-copied "
    "book took a scribe months to produce and cost as much as a farm. Once Johannes Gutenberg had "
    "combined movable metal type, an oil-based ink and a press adapted from those used for wine and "
    "olives, a workshop could print hundreds of copies of a book in the time a scribe needed for one. "
    "Within fifty years there were presses in most of the large towns of Europe, and millions of books "
    "had been printed: bibles and grammars, calendars and almanacs, pamphlets on religion and politics, "
    "and cheap ballads sold at fairs.",
    "Printing also changed how knowledge was checked and corrected. When every copy of a text was "
    "written by hand, each one drifted a little from the others, and an error could not easily be "
    "traced back to its source. Printed copies were identical, so a scholar in one city could point to "
    "a page and a line and be certain that a colleague elsewhere saw the same words. Errata sheets, "
    "indexes, page numbers and title pages all became common in the first century of print. Readers "
    "wrote to authors and printers with corrections, and later editions improved on earlier ones, a "
    "slow and public process that resembles the way software is maintained today.",
    "Mountains make their own weather. Air blown against a range is forced upward, and as it rises it "
    "cools, until the water vapour it carries condenses into cloud and falls as rain or snow on the "
    "windward slopes. By the time the air has crossed the ridge and begun to descend on the other side "
    "it has lost much of its moisture, and it warms as it sinks. That is why one side of a mountain "
    "range can be covered with dense forest while the other, only a few dozen miles away, is dry grass "
    "or desert. The warm, dry wind that pours down the lee side has local names in many parts of the "
    "world, and it can melt a winter's snow in a single afternoon.",
    "Climbers learn to read these signs. A cap of smooth cloud sitting on a summit while the sky around "
    "it is clear means strong winds at height. Towering clouds that build through a summer morning "
    "warn of thunderstorms by early afternoon, which is why guides like to leave their huts before "
    "dawn and be off the exposed ridges by midday. Temperature falls by several degrees for every "
    "thousand metres of height, and the wind makes the cold far more dangerous than the thermometer "
    "suggests. Most accidents in the mountains happen on the way down, when people are tired, the light "
    "is fading and the hardest part seems to be over.",
    "A public library is a strange institution when one thinks about it. It lends valuable things to "
    "strangers for free, asks only that they be returned, and trusts that most people will do so. "
    "Early libraries chained their books to the shelves, because each volume was precious; later ones "
    "kept the shelves closed, and readers filled in slips that a librarian carried to the stacks. The "
    "open shelf, where anyone can wander and pull down a book they did not know they wanted, is a "
    "fairly recent idea, and it changed reading as much as any new technology did.",
    "Librarians have always been in the business of organising information. Card catalogues, "
    "classification schemes and subject headings were all attempts to answer the same question: given "
    "a reader with a vague need, how do we lead them to the few items, among millions, that will help? "
    "The answers were imperfect and often reflected the assumptions of the people who designed them. "
    "Search engines face the same question at a vastly larger scale, and they too reflect the choices "
    "of their builders, even when those choices are hidden inside ranking formulas that no single "
    "person fully understands.",
    "Railways forced the world to agree on what time it was. Before the railway each town kept its own "
    "local time, set by the sun at noon, so that a clock in a western town ran several minutes behind "
    "one in a town further east. Nobody minded while travel was slow. Once trains ran to timetables "
    "across hundreds of miles, the differences caused missed connections and, worse, collisions on "
    "single-track lines. Railway companies adopted standard times for their own operations, and "
    "governments eventually followed, dividing the globe into the time zones that we now take for "
    "granted whenever we set a watch or schedule a call.",
    "The stations themselves became the cathedrals of the industrial age. Their iron and glass roofs "
    "spanned wider spaces than any building before them, and their halls were designed to impress "
    "travellers with the power and confidence of the companies that built them. Around them grew hotels, "
    "newspaper stands, cafes and the first chains of shops selling books to read on the journey. A "
    "traveller of the time could cross a country in a day that their grandparents would have needed a "
    "week to cross on horseback, and the sense that distance itself had shrunk runs through the "
    "novels, letters and paintings of the period.",
    "Musical instruments are a record of the materials each culture had at hand. Flutes have been "
    "carved from bird bones and mammoth ivory, drums stretched with animal skins over hollow logs, and "
    "strings twisted from gut or silk. The violin family reached its classic form in a few workshops "
    "in northern Italy in the seventeenth and eighteenth centuries, and makers still argue about what "
    "made those instruments sound as they do: the wood, the varnish, the climate in which the trees "
    "grew, or simply the skill of hands that knew exactly how thin to carve each plate.",
    "The piano took more than a century to become the instrument we know. Its early forms were quiet "
    "and light, with thin strings on a wooden frame, suitable for a drawing room but easily lost in a "
    "concert hall. Composers kept asking for more volume and a wider range, and builders responded "
    "with heavier strings, cast iron frames that could hold tons of tension, and actions that let a "
    "pianist repeat a note quickly. The music written for the instrument changed along with it, and a "
    "sonata composed for one of the early pianos can sound surprisingly different when it is played "
    "on a modern concert grand.",
    "Maps are arguments as much as pictures. Every flat map of the round earth must stretch or squeeze "
    "something, and the mapmaker chooses what to keep true: the shapes of coastlines, the relative "
    "areas of countries, or the straight compass bearings that sailors needed. The projection that "
    "hangs on many classroom walls was designed for navigation, and it makes regions near the poles "
    "look far larger than they are. Children who grow up with it often believe that Greenland is about "
    "as large as Africa, when in fact Africa is roughly fourteen times bigger.",
    "Modern maps are built from satellite images, aerial photographs and the traces of millions of "
    "phones, and they are updated continuously rather than printed once every few years. They can tell "
    "a driver about a traffic jam that formed five minutes ago and suggest a way around it. Yet the old "
    "questions remain. Someone still decides which places get names and which roads are shown, which "
    "borders are drawn as settled and which as disputed, and what the map leaves out is often as "
    "revealing as what it shows.",
    "Gardening teaches patience in a way few other hobbies do. Seeds sown in spring may not flower "
    "until summer; a fruit tree planted this year may give its first real harvest in five or six. The "
    "soil itself is alive, full of fungi, worms and bacteria that break down fallen leaves and make "
    "their nutrients available to roots again. Gardeners who pile up compost and avoid digging more "
    "than they must are feeding that hidden population, and they are often rewarded with plants that "
    "cope better with drought and disease than those grown with fertiliser alone.",
    "Every garden is also a small negotiation with the local climate. A plant that thrives against a "
    "warm south-facing wall may die in an open bed a few metres away where frost settles on still "
    "nights. Experienced gardeners keep notes on the dates of the last frost, the first flowering of "
    "each shrub and the arrival of particular insects, and over the years those notebooks become a "
    "record of change. Many report that spring now comes earlier than it did when they began, and "
    "that plants once thought too tender for their region now survive the winter without protection.",
)

ESSAY_TEXT = "\n\n".join(ESSAY_PARAGRAPHS)


class PromptWindows:
    """Prompt k is the `num_tokens` tokens of the essay starting at k * WINDOW_STRIDE_TOKENS, wrapping around."""

    def __init__(self, essay_token_ids: list[int], num_tokens: int) -> None:
        self._essay_token_ids = essay_token_ids
        self._num_tokens = num_tokens

    @classmethod
    def from_model_folder(cls, model_dir: Path, num_tokens: int) -> PromptWindows:
        """Tokenize the essay with the model's own tokenizer (tokenizer.json), without special tokens."""
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found; pass --model, or run `.venv/bin/specserve prepare-model`"
            )
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        return cls(tokenizer.encode(ESSAY_TEXT, add_special_tokens=False).ids, num_tokens)

    @property
    def num_essay_tokens(self) -> int:
        return len(self._essay_token_ids)

    def prompt_token_ids(self, index: int) -> list[int]:
        num_essay_tokens = len(self._essay_token_ids)
        start = index * WINDOW_STRIDE_TOKENS
        return [self._essay_token_ids[(start + i) % num_essay_tokens] for i in range(self._num_tokens)]
